"""Single-process dcp.save/dcp.load round trips: MmapWriter/MmapReader against the stock pair.

Every comparison is bitwise (NaN payloads, -0.0, bf16 and fp8 included), and the
bytes at each storage record's (file, offset, length) are checked to be the
tensor's own bytes at an aligned offset.
"""

from __future__ import annotations

import io
import json
import os
import re
import pickle
import struct
import sys
import tempfile
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

import mmapckpt
from helpers import assert_tree_equal, dcp_failure, dcp_load, dcp_save, tensor_bytes
from strategies import fresh_like, flatten, state_dicts, tensor_from_bytes, tensor_state_dicts

PROPERTY = settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def _metadata(path: str) -> Metadata:
    return mmapckpt.MmapReader(path).read_metadata()


def _shard_header(path: str) -> dict[str, Any]:
    """The JSON header of a shard, parsed here without mmapckpt (preamble: 8s H H B 3x Q I 4x)."""
    with open(path, "rb") as f:
        pre = f.read(32)
        magic, _major, _minor, _order, hlen, _crc = struct.unpack("<8sHHB3xQI4x", pre)
        assert magic == b"MMAPCKPT"
        return json.loads(f.read(hlen))


def check_storage_records(path: str, sd: dict[str, Any], *, alignment: int = 4096) -> int:
    """For every entry of the checkpoint at ``path``: the bytes at (file, offset, length)
    are the original value's bytes, at an aligned offset. Returns the number of tensor entries."""
    md = _metadata(path)
    flat = flatten(sd)
    assert set(md.state_dict_metadata) == set(flat)
    assert {idx.fqn for idx in md.storage_data} == set(flat)
    n_tensors = 0
    headers: dict[str, dict[str, Any]] = {}
    for idx, info in md.storage_data.items():
        file = os.path.join(path, info.relative_path)
        with open(file, "rb") as f:
            f.seek(info.offset)
            data = f.read(info.length)
        assert len(data) == info.length, f"{idx.fqn}: record runs past the end of {file}"
        hdr = headers.setdefault(file, _shard_header(file))
        [entry] = [e for e in hdr["entries"] if e["fqn"] == idx.fqn]
        assert (entry["offset"], entry["length"]) == (info.offset, info.length)
        value = flat[idx.fqn]
        if isinstance(md.state_dict_metadata[idx.fqn], BytesStorageMetadata):
            assert not isinstance(value, torch.Tensor) and entry["kind"] == "bytes"
            # BYTE_IO entries hold the planner's torch.save bytes as given
            assert_tree_equal(value, torch.load(io.BytesIO(data), weights_only=True), idx.fqn)
            continue
        n_tensors += 1
        assert isinstance(md.state_dict_metadata[idx.fqn], TensorStorageMetadata)
        assert tuple(idx.offset) == (0,) * value.dim()  # one process: the chunk is the whole tensor
        assert data == tensor_bytes(value), f"{idx.fqn}: bytes at offset {info.offset} differ"
        assert info.length == value.numel() * value.element_size()
        assert info.offset % 64 == 0, f"{idx.fqn}: offset {info.offset} not a multiple of 64"
        assert info.offset % value.element_size() == 0
        if info.length >= alignment:
            assert info.offset % alignment == 0, f"{idx.fqn}: {info.length} bytes at {info.offset}"
    return n_tensors


# --------------------------------------------------------------------------- properties
@PROPERTY
@given(sd=state_dicts(), writer_threads=st.integers(1, 3), reader_threads=st.integers(1, 2))
def test_roundtrip_matches_stock_bitwise(sd: dict[str, Any], writer_threads: int, reader_threads: int) -> None:
    with tempfile.TemporaryDirectory() as d:
        stock, mm = os.path.join(d, "stock"), os.path.join(d, "mm")
        dcp_save(sd, FileSystemWriter(stock, sync_files=False))
        dcp_save(sd, mmapckpt.MmapWriter(mm, sync_files=False, thread_count=writer_threads))
        loaded = {
            "stock+FileSystemReader": dcp_load(fresh_like(sd), FileSystemReader(stock)),
            "stock+MmapReader": dcp_load(fresh_like(sd, 0xA5), mmapckpt.MmapReader(stock, thread_count=reader_threads)),
            "mmap+MmapReader": dcp_load(fresh_like(sd), mmapckpt.MmapReader(mm, thread_count=reader_threads)),
            "mmap+MmapReader(fill 0xA5)": dcp_load(fresh_like(sd, 0xA5), mmapckpt.MmapReader(mm)),
        }
        for name, got in loaded.items():
            assert_tree_equal(sd, got, name)
        assert_tree_equal(loaded["stock+FileSystemReader"], loaded["mmap+MmapReader"], "stock vs mmap")
        check_storage_records(mm, sd)


@pytest.mark.slow
@settings(PROPERTY, max_examples=250)
@given(sd=state_dicts(), writer_threads=st.integers(1, 3))
def test_roundtrip_many_examples(sd: dict[str, Any], writer_threads: int) -> None:
    """The property above with more examples (CI runs it; deselect with -m 'not slow')."""
    with tempfile.TemporaryDirectory() as d:
        stock, mm = os.path.join(d, "stock"), os.path.join(d, "mm")
        dcp_save(sd, FileSystemWriter(stock, sync_files=False))
        dcp_save(sd, mmapckpt.MmapWriter(mm, sync_files=False, thread_count=writer_threads))
        from_stock = dcp_load(fresh_like(sd, 0xA5), mmapckpt.MmapReader(stock))
        from_mm = dcp_load(fresh_like(sd, 0xA5), mmapckpt.MmapReader(mm))
        assert_tree_equal(sd, from_stock, "stock+MmapReader")
        assert_tree_equal(sd, from_mm, "mmap+MmapReader")
        check_storage_records(mm, sd)


@PROPERTY
@given(sd=tensor_state_dicts(), alignment=st.sampled_from([64, 128, 512, 8192]))
def test_custom_alignment_property(sd: dict[str, Any], alignment: int) -> None:
    with tempfile.TemporaryDirectory() as d:
        dcp_save(sd, mmapckpt.MmapWriter(d, sync_files=False, alignment=alignment))
        check_storage_records(d, sd, alignment=alignment)
        assert_tree_equal(sd, dcp_load(fresh_like(sd, 0x5A), mmapckpt.MmapReader(d)))


# --------------------------------------------------------------------------- alignment, deterministic
def _sized_state_dict() -> dict[str, Any]:
    """Entries of byte lengths around the 64-byte and 4096-byte boundaries, odd ones between."""
    g = torch.Generator().manual_seed(7)

    def u8(n: int) -> torch.Tensor:
        return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)

    return {
        "one_byte": u8(1),
        "odd": u8(3),
        "b63": u8(63),
        "b64": u8(64),
        "f64_100": tensor_from_bytes(u8(800).numpy().tobytes(), torch.float64, (10, 10)),
        "b4095": u8(4095),
        "b4096": u8(4096),
        "b4097": u8(4097),
        "bf16_big": tensor_from_bytes(u8(2 * 3 * 1000).numpy().tobytes(), torch.bfloat16, (3, 1000)),
        "c128": tensor_from_bytes(u8(16 * 7).numpy().tobytes(), torch.complex128, (7,)),
        "text": "a string between tensors",
        "empty": torch.empty(0, 4, dtype=torch.float32),
        "scalar": torch.tensor(-0.0, dtype=torch.float16),
    }


def test_default_alignment_and_records(tmp_path) -> None:
    sd = _sized_state_dict()
    dcp_save(sd, mmapckpt.MmapWriter(tmp_path))  # defaults: sync_files=True, alignment=4096
    assert check_storage_records(str(tmp_path), sd) == 12
    md = _metadata(str(tmp_path))
    offsets = {idx.fqn: info.offset for idx, info in md.storage_data.items()}
    for name in ("b4096", "b4097", "bf16_big"):
        assert offsets[name] % 4096 == 0
    assert_tree_equal(sd, dcp_load(fresh_like(sd, 0xA5), mmapckpt.MmapReader(tmp_path)))


@pytest.mark.parametrize("alignment", [64, 256, 65536])
def test_custom_alignment(tmp_path, alignment: int) -> None:
    sd = _sized_state_dict()
    dcp_save(sd, mmapckpt.MmapWriter(tmp_path, alignment=alignment, sync_files=False))
    check_storage_records(str(tmp_path), sd, alignment=alignment)
    md = _metadata(str(tmp_path))
    for idx, info in md.storage_data.items():
        if info.length >= alignment:
            assert info.offset % alignment == 0
    if alignment == 65536:  # entries shorter than the alignment are only 64-aligned, not padded to 64 KiB
        small = [info.offset for info in md.storage_data.values() if 0 < info.length < 4096]
        assert any(o % 4096 for o in small)
    assert_tree_equal(sd, dcp_load(fresh_like(sd, 0xA5), mmapckpt.MmapReader(tmp_path)))


@pytest.mark.parametrize("alignment", [0, 32, 100, 4095, -64])
def test_invalid_alignment_refused(tmp_path, alignment: int) -> None:
    with pytest.raises(ValueError):
        mmapckpt.MmapWriter(tmp_path, alignment=alignment)


def test_invalid_thread_counts_refused(tmp_path) -> None:
    with pytest.raises(ValueError):
        mmapckpt.MmapWriter(tmp_path, thread_count=0)
    with pytest.raises(ValueError):
        mmapckpt.MmapReader(tmp_path, thread_count=0)


# --------------------------------------------------------------------------- threads and files
def _many_tensors() -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    sd: dict[str, Any] = {f"layer{i}": {"w": torch.randn(16, 8 + i, generator=g), "b": torch.randn(8 + i, generator=g)}
                          for i in range(5)}
    sd["step"] = 12
    sd["half"] = torch.randn(33, generator=g).to(torch.bfloat16)
    return sd


@pytest.mark.parametrize("threads", [2, 3])
def test_thread_count_writes_several_files(tmp_path, threads: int) -> None:
    sd = _many_tensors()
    dcp_save(sd, mmapckpt.MmapWriter(tmp_path, thread_count=threads))
    shards = sorted(n for n in os.listdir(tmp_path) if n.endswith(".distcp"))
    assert shards == [f"__0_{i}.distcp" for i in range(threads)]
    md = _metadata(str(tmp_path))
    assert {info.relative_path for info in md.storage_data.values()} == set(shards)
    assert sorted(os.listdir(tmp_path)) == sorted(shards + [".metadata"])  # no temp files left
    check_storage_records(str(tmp_path), sd)
    for reader_threads in (1, threads):
        assert_tree_equal(sd, dcp_load(fresh_like(sd, 0xA5), mmapckpt.MmapReader(tmp_path, thread_count=reader_threads)))


def test_thread_count_one_writes_one_file(tmp_path) -> None:
    dcp_save(_many_tensors(), mmapckpt.MmapWriter(tmp_path))
    assert sorted(os.listdir(tmp_path)) == [".metadata", "__0_0.distcp"]


# --------------------------------------------------------------------------- overwrite
def test_overwrite_false_refuses_existing_checkpoint(tmp_path) -> None:
    first = {"w": torch.arange(6, dtype=torch.int32)}
    dcp_save(first, mmapckpt.MmapWriter(tmp_path))
    before = {n: (tmp_path / n).read_bytes() for n in os.listdir(tmp_path)}
    with pytest.raises(BaseException) as ei:
        dcp_save({"w": torch.zeros(6, dtype=torch.int32)}, mmapckpt.MmapWriter(tmp_path, overwrite=False))
    err = dcp_failure(ei.value)
    assert isinstance(ei.value, dcp.api.CheckpointException)
    assert isinstance(err, mmapckpt.CheckpointExistsError) and isinstance(err, FileExistsError)
    assert str(tmp_path) in str(err) and "overwrite" in str(err)
    after = {n: (tmp_path / n).read_bytes() for n in os.listdir(tmp_path)}
    assert after == before  # the refused save touched nothing
    assert_tree_equal(first, dcp_load(fresh_like(first), mmapckpt.MmapReader(tmp_path)))


def test_overwrite_false_refuses_stock_checkpoint(tmp_path) -> None:
    dcp_save({"w": torch.ones(2)}, FileSystemWriter(tmp_path))
    with pytest.raises(BaseException) as ei:
        dcp_save({"w": torch.zeros(2)}, mmapckpt.MmapWriter(tmp_path, overwrite=False))
    assert isinstance(dcp_failure(ei.value), mmapckpt.CheckpointExistsError)


def test_overwrite_false_matches_the_stock_writers_error(tmp_path) -> None:
    """Code written for FileSystemWriter catches RuntimeError and matches "Checkpoint already exists"."""
    dcp_save({"w": torch.ones(2)}, mmapckpt.MmapWriter(tmp_path))
    for writer in (lambda: FileSystemWriter(tmp_path, overwrite=False), lambda: mmapckpt.MmapWriter(tmp_path, overwrite=False)):
        with pytest.raises(BaseException) as ei:
            dcp_save({"w": torch.zeros(2)}, writer())
        err = dcp_failure(ei.value)
        assert isinstance(err, RuntimeError) and "Checkpoint already exists" in str(err), err
    assert isinstance(err, mmapckpt.CheckpointExistsError) and isinstance(err, FileExistsError)


def test_overwrite_false_allows_empty_directory(tmp_path) -> None:
    sd = {"w": torch.ones(3)}
    dcp_save(sd, mmapckpt.MmapWriter(tmp_path, overwrite=False))
    assert_tree_equal(sd, dcp_load(fresh_like(sd), mmapckpt.MmapReader(tmp_path)))


def test_overwrite_replaces_and_drops_stale_shards(tmp_path) -> None:
    dcp_save(_many_tensors(), mmapckpt.MmapWriter(tmp_path, thread_count=3))
    assert len([n for n in os.listdir(tmp_path) if n.endswith(".distcp")]) == 3
    new = {"only": torch.full((5,), -0.0, dtype=torch.float64)}
    (tmp_path / "notes.txt").write_text("kept")
    dcp_save(new, mmapckpt.MmapWriter(tmp_path))
    # the new shard could not take the name __0_0.distcp, which the old commit referenced
    names = sorted(os.listdir(tmp_path))
    assert names[0] == ".metadata" and names[2] == "notes.txt" and len(names) == 3, names
    assert re.fullmatch(r"__0_0\.[0-9a-f]{8}\.distcp", names[1]), names
    assert_tree_equal(new, dcp_load(fresh_like(new, 0xA5), mmapckpt.MmapReader(tmp_path)))
    # and the next overwrite takes DCP's own name again, which nothing references any more
    dcp_save(_many_tensors(), mmapckpt.MmapWriter(tmp_path))
    assert sorted(os.listdir(tmp_path)) == [".metadata", "__0_0.distcp", "notes.txt"]
    assert (tmp_path / "notes.txt").read_text() == "kept"


# --------------------------------------------------------------------------- nothing unpickled
class _Unpickled(Exception):
    pass


@pytest.fixture
def forbid_unpickling(monkeypatch):
    """Make every unpickling entry point raise (and record that it was reached).

    Covers pickle.load/loads/Unpickler (the stock metadata path), torch.load and
    torch's weights_only unpickler (the stock shard path).
    """
    calls: list[str] = []

    def trap(name: str):
        def f(*a: Any, **k: Any) -> Any:
            calls.append(name)
            raise _Unpickled(f"unpickling attempted via {name}")
        return f

    class TrapUnpickler(pickle.Unpickler):
        def __init__(self, *a: Any, **k: Any) -> None:
            calls.append("pickle.Unpickler")
            raise _Unpickled("unpickling attempted via pickle.Unpickler")

    import torch._weights_only_unpickler as wou

    monkeypatch.setattr(pickle, "load", trap("pickle.load"))
    monkeypatch.setattr(pickle, "loads", trap("pickle.loads"))
    monkeypatch.setattr(pickle, "Unpickler", TrapUnpickler)
    monkeypatch.setattr(torch, "load", trap("torch.load"))
    monkeypatch.setattr(torch.serialization, "load", trap("torch.serialization.load"))
    monkeypatch.setattr(wou, "load", trap("weights_only_unpickler.load"))
    monkeypatch.setattr(wou.Unpickler, "load", trap("weights_only_unpickler.Unpickler.load"))
    return calls


_AUDIT: dict[str, Any] = {"on": False, "events": []}


def _audit_hook(event: str, args: tuple) -> None:
    if _AUDIT["on"] and event == "pickle.find_class":
        _AUDIT["events"].append(args)


sys.addaudithook(_audit_hook)  # hooks cannot be removed; it records only while a test turns it on


def _tensor_only_sd() -> dict[str, Any]:
    g = torch.Generator().manual_seed(11)
    return {"a": torch.randn(4, 5, generator=g), "b": {"c": torch.randn(3, generator=g).to(torch.float8_e5m2)},
            "l": [{"i": torch.arange(7, dtype=torch.int64)}, {"t": torch.tensor(True)}]}  # lists of dicts are traversed


def test_mmap_load_never_unpickles(tmp_path, forbid_unpickling) -> None:
    sd = _tensor_only_sd()
    dcp_save(sd, mmapckpt.MmapWriter(tmp_path / "mm"))
    _AUDIT["on"], _AUDIT["events"] = True, []
    try:
        got = dcp_load(fresh_like(sd, 0xA5), mmapckpt.MmapReader(tmp_path / "mm"))
    finally:
        _AUDIT["on"] = False
    assert forbid_unpickling == []
    assert _AUDIT["events"] == []
    assert_tree_equal(sd, got)


def test_unpickling_trap_trips_on_stock_checkpoint(tmp_path, forbid_unpickling) -> None:
    """The trap of the test above works: a stock load cannot get past it."""
    sd = _tensor_only_sd()
    dcp_save(sd, FileSystemWriter(tmp_path / "stock"))
    with pytest.raises(BaseException) as ei:
        dcp_load(fresh_like(sd), FileSystemReader(tmp_path / "stock"))
    assert "pickle.load" in forbid_unpickling
    assert "unpickling attempted" in str(dcp_failure(ei.value))
    # MmapReader reads stock metadata with its own restricted unpickler (a subclass bound at
    # import, which the trap does not replace), then reaches torch.load for the stock shards.
    forbid_unpickling.clear()
    with pytest.raises(BaseException):
        dcp_load(fresh_like(sd), mmapckpt.MmapReader(tmp_path / "stock"))
    assert "torch.load" in forbid_unpickling


def test_audit_hook_sees_stock_metadata_unpickling(tmp_path) -> None:
    """The audit-hook half of the no-unpickling check does record a stock load."""
    sd = _tensor_only_sd()
    dcp_save(sd, FileSystemWriter(tmp_path))
    _AUDIT["on"], _AUDIT["events"] = True, []
    try:
        dcp_load(fresh_like(sd), FileSystemReader(tmp_path))
    finally:
        _AUDIT["on"] = False
    assert any("torch.distributed.checkpoint" in str(a) for a in _AUDIT["events"])


def test_mmap_metadata_is_not_a_pickle(tmp_path) -> None:
    dcp_save(_tensor_only_sd(), mmapckpt.MmapWriter(tmp_path))
    data = (tmp_path / ".metadata").read_bytes()
    with pytest.raises(pickle.UnpicklingError):
        pickle.loads(data)  # a stock reader fails on the first byte, running nothing
    assert data[:8] == b"\xffMMAPMD\n"


# --------------------------------------------------------------------------- async_save
def test_async_save_completes_and_loads_back(tmp_path) -> None:
    sd = _sized_state_dict()
    fut = dcp.async_save(sd, storage_writer=mmapckpt.MmapWriter(tmp_path), no_dist=True)
    md = fut.result(timeout=120)
    assert isinstance(md, Metadata)
    assert os.path.isfile(tmp_path / ".metadata")
    check_storage_records(str(tmp_path), sd)
    assert_tree_equal(sd, dcp_load(fresh_like(sd, 0xA5), mmapckpt.MmapReader(tmp_path)))


def test_async_save_then_sync_save_same_directory(tmp_path) -> None:
    a, b = {"w": torch.ones(8)}, {"w": torch.full((8,), 2.0)}
    dcp.async_save(a, storage_writer=mmapckpt.MmapWriter(tmp_path), no_dist=True).result(timeout=120)
    dcp_save(b, mmapckpt.MmapWriter(tmp_path))
    assert_tree_equal(b, dcp_load(fresh_like(b), mmapckpt.MmapReader(tmp_path)))


# --------------------------------------------------------------------------- special values, explicitly
def test_special_float_bit_patterns_survive(tmp_path) -> None:
    """NaN payloads, signalling NaNs, -0.0, infinities and subnormals, in every float width."""
    patterns = {
        torch.float64: [0x7FF0000000000001, 0xFFF8DEADBEEF0001, 0x8000000000000000, 0x0000000000000001, 0xFFF0000000000000],
        torch.float32: [0x7F800001, 0xFFC12345, 0x80000000, 0x00000001, 0x7F800000],
        torch.float16: [0x7C01, 0xFE3F, 0x8000, 0x0001, 0xFC00],
        torch.bfloat16: [0x7F81, 0xFFC1, 0x8000, 0x0001, 0xFF80],
    }
    sd: dict[str, Any] = {}
    for dt, bits in patterns.items():
        width = dt.itemsize
        raw = b"".join(b.to_bytes(width, sys.byteorder) for b in bits)
        sd[str(dt).split(".")[1]] = tensor_from_bytes(raw, dt, (len(bits),))
    for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"):
        if hasattr(torch, name):
            sd[name] = tensor_from_bytes(bytes(range(256)), getattr(torch, name), (16, 16))
    sd["c64"] = tensor_from_bytes(struct.pack("<IIII", 0x7FC00001, 0x80000000, 0xFFFFFFFF, 1), torch.complex64, (2,))
    dcp_save(sd, mmapckpt.MmapWriter(tmp_path / "mm"))
    dcp_save(sd, FileSystemWriter(tmp_path / "stock"))
    for path in ("mm", "stock"):
        got = dcp_load(fresh_like(sd), mmapckpt.MmapReader(tmp_path / path))
        assert_tree_equal(sd, got, path)
    check_storage_records(str(tmp_path / "mm"), sd)


def test_loaded_tensors_are_independent_of_the_file(tmp_path) -> None:
    """Targets own their data: changing the file after a load does not change them."""
    sd = {"w": torch.arange(2048, dtype=torch.float32)}
    dcp_save(sd, mmapckpt.MmapWriter(tmp_path))
    got = dcp_load(fresh_like(sd), mmapckpt.MmapReader(tmp_path))
    info = next(iter(_metadata(str(tmp_path)).storage_data.values()))
    with open(tmp_path / info.relative_path, "r+b") as f:
        f.seek(info.offset)
        f.write(b"\x00" * 64)
    assert_tree_equal(sd, got)
