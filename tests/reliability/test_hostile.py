"""Hostile and damaged files, case by case: bounds, paths, pickles, checksums, odd file types, SIGBUS.

Every entry point that reads a checkpoint is tried: ``MmapReader`` (directly and
through ``dcp.load``), ``mmapckpt.open``, ``mmapckpt.load``, ``mmapckpt.convert`` and
``mmapckpt.verify_checkpoint``. Errors from ``MmapReader.read_metadata`` reach a
``dcp.load`` caller as ``AssertionError("metadata is None; global metadata read failed:
<message>")`` (torch 2.13 catches them); the tests check the message survives.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import signal
import struct
import subprocess
import sys
import tracemalloc
import zlib
from typing import Any, Callable

import pytest
import torch

from helpers import assert_tree_equal, dcp_failure, dcp_load, dcp_save
from helpers import as_metadata_v1, metadata_with_doc, shard_with_header

import mmapckpt
from mmapckpt import (
    CheckpointError,
    ChecksumError,
    EntryBoundsError,
    FormatError,
    MmapReader,
    MmapWriter,
    TruncatedFileError,
    UnknownDtypeError,
    UnsafePathError,
    UnsafePickleError,
)
from mmapckpt.reading.shard import Shard

SHARD = "__0_0.distcp"


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(11)
    return {"a": torch.randn(64, 64, generator=g), "b": torch.randn(100, generator=g).to(torch.bfloat16),
            "c": torch.arange(10, dtype=torch.int64)}


def _targets() -> dict[str, Any]:
    return {k: torch.zeros_like(v) for k, v in _state().items()}


@pytest.fixture()
def ckpt(tmp_path) -> str:
    path = str(tmp_path / "ckpt")
    dcp_save(_state(), MmapWriter(path))
    return path


def _read(path: str, name: str) -> bytes:
    with open(os.path.join(path, name), "rb") as f:
        return f.read()


def _write(path: str, name: str, data: bytes) -> None:
    with open(os.path.join(path, name), "wb") as f:
        f.write(data)


def _header(path: str) -> dict[str, Any]:
    data = _read(path, SHARD)
    (hlen,) = struct.unpack_from("<Q", data, 16)
    return json.loads(data[32:32 + hlen])


def _load_error(path: str, **kw: Any) -> BaseException:
    """The unwrapped failure of dcp.load on ``path``."""
    logging.disable(logging.WARNING)
    try:
        with pytest.raises(BaseException) as info:
            dcp_load(_targets(), MmapReader(path, **kw))
    finally:
        logging.disable(logging.NOTSET)
    return dcp_failure(info.value)


def _refused_everywhere(path: str, cls: type[CheckpointError], *, at_metadata: bool) -> None:
    """MmapReader (and dcp.load), open, load and verify_checkpoint all refuse ``path`` with ``cls``."""
    if at_metadata:
        with pytest.raises(cls):
            MmapReader(path).read_metadata()
        err = _load_error(path)
        assert isinstance(err, cls) or f"global metadata read failed: {path}" in str(err), err
    else:
        assert isinstance(_load_error(path), cls), _load_error(path)
    with pytest.raises(cls):
        with mmapckpt.open(path) as ck:
            for k in ck.keys():
                ck.get_tensor(k)
    with pytest.raises(cls):
        mmapckpt.load(path)
    report = mmapckpt.verify_checkpoint(path)
    assert not report.ok, report


# --------------------------------------------------------------------------- bounds
def test_header_length_past_the_end_is_refused_before_allocating(ckpt):
    data = bytearray(_read(ckpt, SHARD))
    data[16:24] = struct.pack("<Q", 90 * 2**20)  # under the 100 MiB header limit, past the end of the file
    _write(ckpt, SHARD, bytes(data))
    tracemalloc.start()
    with pytest.raises(TruncatedFileError, match="runs past the end"):
        Shard(os.path.join(ckpt, SHARD))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 2**20, f"{peak} bytes allocated for a header claimed to be 90 MiB"
    _refused_everywhere(ckpt, TruncatedFileError, at_metadata=False)


def test_header_length_over_the_limit_is_refused(ckpt):
    data = bytearray(_read(ckpt, SHARD))
    for claim in (100 * 2**20 + 1, 2**63, 2**64 - 1):
        data[16:24] = struct.pack("<Q", claim)
        _write(ckpt, SHARD, bytes(data))
        with pytest.raises(FormatError, match="exceeds the limit"):
            Shard(os.path.join(ckpt, SHARD))


def test_metadata_claiming_a_huge_body_is_refused_before_allocating(ckpt):
    data = bytearray(_read(ckpt, ".metadata"))
    data[16:24] = struct.pack("<Q", 2**62)
    _write(ckpt, ".metadata", bytes(data))
    tracemalloc.start()
    with pytest.raises(FormatError, match="preamble says"):
        MmapReader(ckpt).read_metadata()
    assert tracemalloc.get_traced_memory()[1] < 2**20
    tracemalloc.stop()


@pytest.mark.parametrize("field,value,cls", [
    ("offset", 2**40, TruncatedFileError),
    ("offset", -4096, FormatError),
    ("offset", 2**64, FormatError),
    ("length", 2**63 - 1, FormatError),
    ("shape", [2**62, 2**62], FormatError),
    ("shape", [0, 2**63], FormatError),
    ("dtype", "float128", UnknownDtypeError),
    ("dtype", ["float32"], UnknownDtypeError),
])
def test_header_entry_with_hostile_values_is_refused(ckpt, field, value, cls):
    doc = _header(ckpt)
    doc["entries"][0][field] = value
    _write(ckpt, SHARD, shard_with_header(_read(ckpt, SHARD), doc))
    with pytest.raises(cls):
        Shard(os.path.join(ckpt, SHARD))
    _refused_everywhere(ckpt, cls, at_metadata=False)


def test_zero_size_entry_with_a_huge_dimension_is_refused(tmp_path):
    path = str(tmp_path / "z")
    dcp_save({"e": torch.zeros(0, 3)}, MmapWriter(path))
    doc = _header(path)
    doc["entries"][0]["shape"] = [0, 2**63]  # numel 0 and length 0 still hold; torch cannot make the shape
    _write(path, SHARD, shard_with_header(_read(path, SHARD), doc))
    with pytest.raises(FormatError, match=r"2\*\*63"):
        Shard(os.path.join(path, SHARD))


def test_duplicate_and_overlapping_entries_are_refused(ckpt):
    base = _header(ckpt)
    doc = json.loads(json.dumps(base))
    doc["entries"].append(dict(doc["entries"][0]))
    _write(ckpt, SHARD, shard_with_header(_read(ckpt, SHARD), doc))
    with pytest.raises(EntryBoundsError, match="duplicate"):
        Shard(os.path.join(ckpt, SHARD))
    doc = json.loads(json.dumps(base))
    doc["entries"][1]["offset"] = doc["entries"][0]["offset"] + 64  # inside entry 0's bytes
    _write(ckpt, SHARD, shard_with_header(_read(ckpt, SHARD), doc))
    with pytest.raises(EntryBoundsError, match="overlaps"):
        Shard(os.path.join(ckpt, SHARD))


def test_metadata_and_header_disagreeing_on_an_entry_is_refused(ckpt):
    as_metadata_v1(ckpt)  # the version-1 form: one JSON object per record
    md = _read(ckpt, ".metadata")
    doc = json.loads(md[24:])
    rec = next(r for r in doc["storage_data"] if r["fqn"] == "c")
    rec["file_offset"] += 4096  # still inside the file, but not where the header says
    _write(ckpt, ".metadata", metadata_with_doc(md, doc))
    err = _load_error(ckpt)
    assert isinstance(err, FormatError) and "shard header says" in str(err), err


def test_a_chunk_missing_from_the_shard_header_is_refused(ckpt):
    """The header is valid on its own (an entry removed, CRC recomputed) but does not hold a chunk
    the metadata places in it: every loader refuses, naming the shard and the entry."""
    doc = _header(ckpt)
    doc["entries"] = [e for e in doc["entries"] if e["fqn"] != "b"]
    _write(ckpt, SHARD, shard_with_header(_read(ckpt, SHARD), doc))
    err = _load_error(ckpt)
    assert isinstance(err, FormatError) and err.entry == "b@[0]" and "not in this shard's header" in str(err), err
    for load in (lambda: mmapckpt.load(ckpt), lambda: mmapckpt.load_into(_targets(), ckpt)):
        with pytest.raises(FormatError, match="not in this shard's header") as ei:
            load()
        assert ei.value.entry == "b@[0]" and ei.value.path.endswith(SHARD)


def test_metadata_record_length_not_matching_its_chunk_is_refused(ckpt):
    as_metadata_v1(ckpt)  # the version-1 form: one JSON object per record
    md = _read(ckpt, ".metadata")
    doc = json.loads(md[24:])
    next(r for r in doc["storage_data"] if r["fqn"] == "a")["length"] -= 4
    _write(ckpt, ".metadata", metadata_with_doc(md, doc))
    with pytest.raises(FormatError, match="its chunk holds"):
        MmapReader(ckpt).read_metadata()


# --------------------------------------------------------------------------- paths
@pytest.mark.parametrize("rel", ["../outside.distcp", "/etc/passwd", "sub/../../x", "", "a\\..\\..\\b", "x\x00y"])
def test_storage_paths_leaving_the_directory_are_refused(ckpt, rel):
    as_metadata_v1(ckpt)  # the version-1 form: one JSON object per record
    md = _read(ckpt, ".metadata")
    doc = json.loads(md[24:])
    doc["storage_data"][0]["relative_path"] = rel
    _write(ckpt, ".metadata", metadata_with_doc(md, doc))
    _refused_everywhere(ckpt, UnsafePathError, at_metadata=True)


def test_stock_metadata_with_a_path_leaving_the_directory_is_refused(tmp_path):
    import torch.distributed.checkpoint as dcp

    path = str(tmp_path / "stock")
    dcp.save(_state(), storage_writer=dcp.FileSystemWriter(path), no_dist=True)
    md = pickle.loads(_read(path, ".metadata"))  # our own file, just written by torch
    idx = next(iter(md.storage_data))
    md.storage_data[idx].relative_path = "../../etc/passwd"
    _write(path, ".metadata", pickle.dumps(md))
    with pytest.raises(UnsafePathError):
        MmapReader(path).read_metadata()
    with pytest.raises(UnsafePathError):
        mmapckpt.open(path)


@pytest.mark.parametrize("kind", ["stock", "mmapckpt"])
def test_a_stored_value_that_does_not_deserialize_is_a_format_error(tmp_path, kind):
    """Stock metadata has no checksum: a record moved by one byte (inside its own bytes: overlapping
    the next record would be refused with the metadata) points at bytes torch.load cannot read. (In an mmapckpt checkpoint only damaged data, caught by verify=True, can do that.)"""
    import torch.distributed.checkpoint as dcp

    path = str(tmp_path / "c")
    sd = {"w": torch.ones(8), "cfg": {"lr": 0.5, "name": "x"}}
    if kind == "stock":
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(path), no_dist=True)
        md = pickle.loads(_read(path, ".metadata"))  # our own file, just written by torch
        idx = next(i for i in md.storage_data if i.fqn == "cfg.lr")
        info = md.storage_data[idx]
        md.storage_data[idx] = type(info)(info.relative_path, info.offset + 1, info.length - 1)  # inside its bytes
        _write(path, ".metadata", pickle.dumps(md))
    else:
        dcp_save(sd, MmapWriter(path))
        doc = _header(path)
        e = next(e for e in doc["entries"] if e["fqn"] == "cfg.lr")
        data = bytearray(_read(path, SHARD))
        data[e["offset"]:e["offset"] + 8] = b"\x00" * 8  # the zip's first bytes: not a torch.save file any more
        _write(path, SHARD, bytes(data))
    err = dcp_failure(_raises(lambda: dcp_load({"w": torch.zeros(8), "cfg": {"lr": 0.0, "name": ""}},
                                               MmapReader(path))))
    assert isinstance(err, FormatError) and err.entry == "cfg.lr" and "could not be deserialized" in str(err), err


def _raises(fn: Callable[[], Any]) -> BaseException:
    logging.disable(logging.WARNING)
    try:
        with pytest.raises(BaseException) as info:
            fn()
    finally:
        logging.disable(logging.NOTSET)
    return info.value


def test_symlinked_shard_pointing_outside_is_refused(ckpt, tmp_path):
    outside = tmp_path / "elsewhere.distcp"
    os.replace(os.path.join(ckpt, SHARD), outside)
    os.symlink(outside, os.path.join(ckpt, SHARD))
    _refused_everywhere(ckpt, UnsafePathError, at_metadata=False)
    assert outside.exists()


def test_symlinked_metadata_pointing_outside_is_refused(ckpt, tmp_path):
    outside = tmp_path / "elsewhere.metadata"
    os.replace(os.path.join(ckpt, ".metadata"), outside)
    os.symlink(outside, os.path.join(ckpt, ".metadata"))
    _refused_everywhere(ckpt, UnsafePathError, at_metadata=True)
    os.unlink(os.path.join(ckpt, ".metadata"))
    os.replace(outside, os.path.join(ckpt, "meta.real"))
    os.symlink("meta.real", os.path.join(ckpt, ".metadata"))  # a link that stays inside is followed
    assert_tree_equal(dcp_load(_targets(), MmapReader(ckpt)), _state())


def test_symlinked_shard_inside_the_directory_loads(ckpt):
    os.makedirs(os.path.join(ckpt, "data"))
    os.replace(os.path.join(ckpt, SHARD), os.path.join(ckpt, "data", "real"))
    os.symlink(os.path.join("data", "real"), os.path.join(ckpt, SHARD))
    assert_tree_equal(dcp_load(_targets(), MmapReader(ckpt)), _state())


@pytest.mark.timeout(60)
def test_a_fifo_or_a_directory_in_place_of_a_shard_is_refused_without_hanging(ckpt):
    os.unlink(os.path.join(ckpt, SHARD))
    os.mkfifo(os.path.join(ckpt, SHARD))  # opening a FIFO for reading would block forever
    err = _load_error(ckpt)
    assert isinstance(err, CheckpointError) and "not a regular file" in str(err), err
    os.unlink(os.path.join(ckpt, SHARD))
    os.mkdir(os.path.join(ckpt, SHARD))
    err = _load_error(ckpt)
    assert isinstance(err, CheckpointError), err


# --------------------------------------------------------------------------- no code execution
class _Payload:
    """Unpickling this runs ``open(marker, "w")`` - if anything unpickles it unrestricted."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        return (open, (self.marker, "w"))


class _OsPayload(_Payload):
    def __reduce__(self) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        return (os.system, (f"touch {self.marker}",))


def _stock_with_evil_metadata(tmp_path, payload_cls: type[_Payload], nested: bool) -> tuple[str, str]:
    import torch.distributed.checkpoint as dcp

    path = str(tmp_path / "evil")
    dcp.save(_state(), storage_writer=dcp.FileSystemWriter(path), no_dist=True)
    marker = str(tmp_path / "pwned")
    if nested:  # hidden inside a real Metadata object
        md = pickle.loads(_read(path, ".metadata"))
        md.planner_data = {"x": payload_cls(marker)}
        data = pickle.dumps(md)
    else:
        data = pickle.dumps(payload_cls(marker))
    _write(path, ".metadata", data)
    return path, marker


@pytest.mark.parametrize("payload_cls", [_Payload, _OsPayload])
@pytest.mark.parametrize("nested", [False, True])
def test_crafted_pickle_metadata_never_runs(tmp_path, payload_cls, nested):
    path, marker = _stock_with_evil_metadata(tmp_path, payload_cls, nested)
    with pytest.raises(UnsafePickleError):
        MmapReader(path).read_metadata()
    err = _load_error(path)
    assert "refers to" in str(err) and "not a DCP metadata class" in str(err), err
    for fn in (mmapckpt.open, mmapckpt.load):
        with pytest.raises(UnsafePickleError):
            fn(path)
    with pytest.raises(CheckpointError):
        mmapckpt.convert(path, str(tmp_path / "out"), to="mmapckpt")
    mmapckpt.verify_checkpoint(path)
    assert not os.path.exists(marker), "a pickle in the metadata ran code"
    pickle.loads(_read(path, ".metadata"))  # control: what the stock reader's plain pickle.load does
    assert os.path.exists(marker)


def test_crafted_pickle_in_a_stock_shard_item_never_runs(tmp_path):
    import torch.distributed.checkpoint as dcp

    path = str(tmp_path / "stock")
    dcp.save(_state(), storage_writer=dcp.FileSystemWriter(path), no_dist=True)
    md = pickle.loads(_read(path, ".metadata"))
    idx = next(i for i in md.storage_data if i.fqn == "a")
    info = md.storage_data[idx]
    marker = str(tmp_path / "pwned")
    import io
    buf = io.BytesIO()
    torch.save(_Payload(marker), buf)
    evil = buf.getvalue()
    data = bytearray(_read(path, info.relative_path))
    data[info.offset:info.offset + len(evil)] = evil  # a torch.save zip whose pickle runs open()
    info.length = len(evil)
    _write(path, info.relative_path, bytes(data))
    _write(path, ".metadata", pickle.dumps(md))
    err = _load_error(path)
    assert isinstance(err, FormatError), err
    with pytest.raises(CheckpointError):
        mmapckpt.load(path)
    assert not os.path.exists(marker), "a pickle in a stock shard ran code"
    torch.load(io.BytesIO(evil), weights_only=False)  # control: the payload is live
    assert os.path.exists(marker)


def test_mmapckpt_non_tensor_values_are_not_unpickled_unless_asked(tmp_path):
    path = str(tmp_path / "objs")
    marker = str(tmp_path / "pwned")
    dcp_save({"t": torch.ones(3), "obj": _Payload(marker)}, MmapWriter(path))
    assert not os.path.exists(marker)
    out = mmapckpt.load(path)
    assert set(out) >= {"t"} and not os.path.exists(marker)
    with mmapckpt.open(path) as ck, pytest.raises(CheckpointError, match="allow_unpickle"):
        ck.get_object("obj")
    mmapckpt.verify_checkpoint(path)
    assert not os.path.exists(marker)
    with mmapckpt.open(path) as ck:  # control: the payload is live once unpickling is allowed
        ck.get_object("obj", allow_unpickle=True)
    assert os.path.exists(marker)


# --------------------------------------------------------------------------- checksums
def test_a_flipped_tensor_byte_is_found_by_verify(ckpt):
    doc = _header(ckpt)
    e = next(e for e in doc["entries"] if e["fqn"] == "a")
    data = bytearray(_read(ckpt, SHARD))
    data[e["offset"] + 1234] ^= 0x10
    _write(ckpt, SHARD, bytes(data))
    err = _load_error(ckpt, verify=True)
    assert isinstance(err, ChecksumError) and err.entry is not None and err.entry.startswith("a@"), err
    assert err.path is not None and err.path.endswith(SHARD)
    report = mmapckpt.verify_checkpoint(ckpt)
    assert not report.ok and any(p.entry and p.entry.startswith("a") for p in report.problems), report
    # without verify the load is not checked: the flipped byte arrives (verification is opt-in)
    got = dcp_load(_targets(), MmapReader(ckpt))
    assert not torch.equal(got["a"].view(torch.int32), _state()["a"].view(torch.int32))
    assert torch.equal(got["c"], _state()["c"])


# --------------------------------------------------------------------------- SIGBUS: the documented limit
_SIGBUS_CHILD = r"""
import os, sys, tempfile, torch, warnings
warnings.simplefilter("ignore")
sys.path.insert(0, sys.argv[1])
from helpers import dcp_save
from mmapckpt import MmapWriter
from mmapckpt.reading.shard import Shard
path, mode = sys.argv[2], sys.argv[3]
dcp_save({"a": torch.arange(1 << 20, dtype=torch.float32)}, MmapWriter(path))
f = os.path.join(path, "__0_0.distcp")
s = Shard(f)
e = s.entry("a", (0,))
if mode == "truncate":      # shrinking the mapped file in place (truncate, cp over it, rsync --inplace)
    os.truncate(f, 4096)
else:                       # replacing it by rename, as MmapWriter does
    dcp_save({"a": torch.zeros(1 << 20)}, MmapWriter(path))
print(float(s.tensor(e).sum()), flush=True)
"""


@pytest.mark.parametrize("mode", ["truncate", "replace"])
def test_sigbus_only_when_a_mapped_file_is_truncated_in_place(tmp_path, mode):
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # where helpers.py lives
    r = subprocess.run([sys.executable, "-c", _SIGBUS_CHILD, tests, str(tmp_path / "c"), mode],
                       capture_output=True, text=True, timeout=120)
    if mode == "truncate":
        assert r.returncode == -signal.SIGBUS, (r.returncode, r.stderr[-2000:])
    else:
        assert r.returncode == 0, r.stderr[-2000:]
        assert float(r.stdout.strip()) == float(sum(range(1 << 20)))  # the old bytes, still mapped


@pytest.mark.parametrize("field", [b"state_dict_metadata", b"storage_data", b"relative_path", b"fqn", b"chunks",
                                   b"properties", b"sizes"])
def test_stock_metadata_with_a_renamed_field_is_refused(tmp_path, field):
    """A bit flip inside a field name makes the pickle build objects lacking that field (found by the fuzzer)."""
    import torch.distributed.checkpoint as dcp

    path = str(tmp_path / "stock")
    dcp.save(_state(), storage_writer=dcp.FileSystemWriter(path), no_dist=True)
    data = _read(path, ".metadata")
    assert field in data
    _write(path, ".metadata", data.replace(field, bytes([field[0] ^ 1]) + field[1:]))
    with pytest.raises(FormatError):
        MmapReader(path).read_metadata()


def test_dcp_load_with_the_safe_planner_never_unpickles_payloads(tmp_path):
    """Non-tensor values are pickles inside the shards. DCP's DefaultLoadPlanner unpickles them with
    weights_only=False (DCP's behaviour, shown as the control); SafeLoadPlanner refuses the payload."""
    import torch.distributed.checkpoint as dcp

    path, marker = str(tmp_path / "objs"), str(tmp_path / "pwned")
    dcp_save({"t": torch.ones(3), "obj": _Payload(marker)}, MmapWriter(path))
    with pytest.raises(BaseException) as info:
        dcp.load({"t": torch.zeros(3), "obj": None}, storage_reader=MmapReader(path),
                 planner=mmapckpt.SafeLoadPlanner(), no_dist=True)
    assert isinstance(dcp_failure(info.value), CheckpointError), dcp_failure(info.value)
    assert not os.path.exists(marker)
    dcp.load({"t": torch.zeros(3), "obj": None}, storage_reader=MmapReader(path), no_dist=True)
    assert os.path.exists(marker)  # the stock planner ran the payload: use SafeLoadPlanner for untrusted files


@pytest.mark.parametrize("name,evil", [
    # push None, then LONG_BINPUT at memo index 2**31: the C unpickler grows its memo table to 2**31 slots
    ("huge memo index", b"\x80\x04N" + b"r" + struct.pack("<I", 2**31) + b"."),
    ("huge memo get", b"\x80\x04" + b"j" + struct.pack("<I", 2**31 - 1) + b"."),
    # BINBYTES8 and BINUNICODE8 claiming 2**40 bytes: allocated before the read finds nothing there
    ("huge bytes8", b"\x80\x04\x8e" + struct.pack("<Q", 2**40) + b"xx."),
    ("huge unicode8", b"\x80\x04\x8d" + struct.pack("<Q", 2**33) + b"xx."),
    ("huge frame", b"\x80\x04\x95" + struct.pack("<Q", 2**62) + b"N."),
])
def test_stock_metadata_pickle_claiming_huge_sizes_is_refused_before_allocating(tmp_path, name, evil):
    """Found by the atheris harness (fuzz/): a mutated memo index made the unpickler allocate gigabytes."""
    path = tmp_path / "stock"
    path.mkdir()
    (path / ".metadata").write_bytes(evil)
    tracemalloc.start()
    with pytest.raises(FormatError) as info:
        MmapReader(str(path)).read_metadata()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert "MemoryError" not in str(info.value)
    assert peak < 16 * 2**20, f"{name}: {peak} bytes allocated"


def test_stock_metadata_with_a_chunk_moved_outside_its_tensor_is_refused(tmp_path):
    """Found by the fuzzer: one flipped bit moved a chunk to offset 8 of a 5-row tensor; DCP's planner
    then found no chunk overlapping the target and left it unloaded, silently."""
    import torch.distributed.checkpoint as dcp

    path = str(tmp_path / "stock")
    dcp.save(_state(), storage_writer=dcp.FileSystemWriter(path), no_dist=True)
    md = pickle.loads(_read(path, ".metadata"))
    chunk = md.state_dict_metadata["b"].chunks[0]
    chunk.offsets = torch.Size([8])
    _write(path, ".metadata", pickle.dumps(md))
    with pytest.raises(FormatError, match="not a valid DCP item"):
        MmapReader(path).read_metadata()
    md.state_dict_metadata["b"].chunks[0].offsets = torch.Size([0])  # inside again, but no record there:
    idx = next(i for i in md.storage_data if i.fqn == "b")
    md.storage_data[type(idx)("b", torch.Size([3]), idx.index)] = md.storage_data.pop(idx)
    _write(path, ".metadata", pickle.dumps(md))
    with pytest.raises(FormatError, match="matches no chunk"):
        MmapReader(path).read_metadata()
