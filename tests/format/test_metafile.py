"""The .metadata codec: JSON round trips against real DCP Metadata, malformed files, and the
restricted unpickler for stock metadata (real files accepted, code-running pickles refused)."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import pickle
import struct
import tempfile
import zlib
from typing import Any, Callable

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import HealthCheck, given, settings
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)

import mmapckpt
from mmapckpt.dcp.metadata import decode_metadata, read_metadata_file
from mmapckpt.format import metadata as mf
from mmapckpt.format.entries import safe_relative_path
from strategies import state_dicts


def _sd() -> dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    return {
        "w": torch.randn(4, 5, generator=g).t(),
        "p": torch.nn.Parameter(torch.randn(3, generator=g)),  # requires_grad=True survives
        "e": torch.empty(0, 7, dtype=torch.float8_e4m3fn),
        "s": torch.tensor(2, dtype=torch.uint64),
        "txt": "hello",
        "nested": {"l": [torch.ones(2, dtype=torch.complex64), {"k": 3}]},
    }


def stock_metadata(sd: dict[str, Any], path: str) -> Metadata:
    """The Metadata the stock writer produces (and pickles) for ``sd``."""
    return dcp.save(sd, storage_writer=FileSystemWriter(path, sync_files=False), no_dist=True)


def with_raw_lengths(md: Metadata) -> Metadata:
    """``md`` with each tensor record's length set to the chunk's raw byte count, as an mmapckpt
    checkpoint has (stock records hold torch.save sizes, which a raw format cannot have)."""
    md = copy.deepcopy(md)
    for idx, info in list(md.storage_data.items()):
        item = md.state_dict_metadata[idx.fqn]
        if isinstance(item, TensorStorageMetadata):
            [chunk] = [c for c in item.chunks if tuple(c.offsets) == tuple(idx.offset)]
            n = item.properties.dtype.itemsize
            for s in chunk.sizes:
                n *= s
            md.storage_data[idx] = _StorageInfo(info.relative_path, info.offset, n)
    md.storage_meta = StorageMeta(checkpoint_id=os.fspath(md.storage_meta.checkpoint_id),
                                  save_id=md.storage_meta.save_id, modules=list(md.storage_meta.modules))
    return md


def assert_metadata_equal(a: Metadata, b: Metadata) -> None:
    assert a.state_dict_metadata == b.state_dict_metadata
    assert a.planner_data == b.planner_data
    assert a.version == b.version
    assert a.storage_meta == b.storage_meta
    # MetadataIndex ignores `index` when compared; compare it explicitly too.
    ka = sorted((i.fqn, tuple(i.offset or ()), i.index, dataclasses.astuple(v)) for i, v in a.storage_data.items())
    kb = sorted((i.fqn, tuple(i.offset or ()), i.index, dataclasses.astuple(v)) for i, v in b.storage_data.items())
    assert ka == kb


# --------------------------------------------------------------------------- round trips
def test_round_trip_of_stock_writer_metadata(tmp_path) -> None:
    md = with_raw_lengths(stock_metadata(_sd(), str(tmp_path)))
    data = mf.encode_metadata(md)
    assert data[:8] == b"\xffMMAPMD\n"
    back = decode_metadata(data, "m")
    assert_metadata_equal(md, back)
    assert back.state_dict_metadata["p"].properties.requires_grad is True
    assert back.state_dict_metadata["e"].properties.dtype == torch.float8_e4m3fn
    assert mf.encode_metadata(back) == data  # canonical: re-encoding gives the same bytes


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(sd=state_dicts())
def test_round_trip_property(sd: dict[str, Any]) -> None:
    with tempfile.TemporaryDirectory() as d:
        stock = stock_metadata(sd, os.path.join(d, "s"))
        mine = dcp.save(sd, storage_writer=mmapckpt.MmapWriter(os.path.join(d, "m"), sync_files=False), no_dist=True)
        # The planner side of the metadata is the same for both writers.
        assert mine.state_dict_metadata == stock.state_dict_metadata
        assert mine.planner_data == stock.planner_data
        assert {(i.fqn, tuple(i.offset or ())) for i in mine.storage_data} == \
               {(i.fqn, tuple(i.offset or ())) for i in stock.storage_data}
        kind, on_disk = read_metadata_file(os.path.join(d, "m", ".metadata"))
        assert kind == "mmapckpt"
        assert_metadata_equal(mine, on_disk)
        raw = with_raw_lengths(stock)
        assert_metadata_equal(raw, decode_metadata(mf.encode_metadata(raw), "m"))


def test_stock_lengths_are_refused_by_the_json_decoder(tmp_path) -> None:
    """A record whose length is not its chunk's raw byte count cannot be an mmapckpt record."""
    md = stock_metadata({"w": torch.ones(4)}, str(tmp_path))
    md.storage_meta = None
    with pytest.raises(mmapckpt.FormatError, match="its chunk holds 16"):
        decode_metadata(mf.encode_metadata(md), "m")


def test_encode_refuses_what_json_cannot_hold() -> None:
    md = Metadata(state_dict_metadata={}, planner_data=object())
    with pytest.raises(TypeError):
        mf.encode_metadata(md)
    md = Metadata(state_dict_metadata={}, planner_data={"a": ("a", 1.5)})
    with pytest.raises(TypeError):
        mf.encode_metadata(md)


def test_metadata_file_layout(tmp_path) -> None:
    """magic, u16 major, u16 minor, u32 CRC-32 of the body, u64 body length, then the JSON body."""
    dcp.save(_sd(), storage_writer=mmapckpt.MmapWriter(tmp_path), no_dist=True)
    raw = (tmp_path / ".metadata").read_bytes()
    magic, major, minor, crc, blen = struct.unpack_from("<8sHHIQ", raw)
    body = raw[24:]
    assert (magic, major, minor) == (b"\xffMMAPMD\n", 2, 0)
    assert blen == len(body) and crc == zlib.crc32(body)
    doc = json.loads(body)
    assert set(doc) >= {"version", "planner_data", "table", "storage_meta"}
    t = doc["table"]
    assert t["files"] == ["__0_0.distcp"] and "float32" in t["dtypes"]
    # rows, name by name: w is dtype, flags, ndim, size, one whole chunk (file, file_offset, length, index, 1)
    p = 0
    for name in t["names"]:
        if t["rows"][p] < 0:
            assert name == "txt" or not name.startswith("w")
            p += 5
            continue
        nd = t["rows"][p + 2]
        if name == "w":
            code, flags, _, *size = t["rows"][p:p + 3 + nd]
            assert t["dtypes"][code] == "float32" and flags == 0 and size == [5, 4]
            f, off, length, _, whole = t["rows"][p + 4 + nd:p + 9 + nd]
            assert (f, length, whole) == (0, 80, 1) and off % 64 == 0
        p += 4 + nd + 5 * t["rows"][p + 3 + nd]  # every chunk of this test's tensors is whole
    assert p == len(t["rows"])
    v1 = json.loads(mf.encode_metadata(decode_metadata(raw, "m"), major=1)[24:])  # the older form
    assert v1["state_dict_metadata"]["w"] == {"type": "tensor", "dtype": "float32", "requires_grad": False,
                                              "size": [5, 4], "chunks": [{"offsets": [0, 0], "sizes": [5, 4]}]}


def test_metadata_kind() -> None:
    assert mf.metadata_kind(b"\xffMMAPMD\n") == "mmapckpt"
    assert mf.metadata_kind(b"\x80\x04\x95") == "dcp"
    assert mf.metadata_kind(b"(dp0\n") is None  # protocol-0 pickles are not DCP metadata
    assert mf.metadata_kind(b"") is None


# --------------------------------------------------------------------------- malformed mmapckpt metadata
def _good_doc() -> dict[str, Any]:
    md = with_raw_lengths(stock_metadata(_sd(), tempfile.mkdtemp()))
    return json.loads(mf.encode_metadata(md, major=1)[24:])


_GOOD = None


def good_doc() -> dict[str, Any]:
    global _GOOD
    if _GOOD is None:
        _GOOD = _good_doc()
    return copy.deepcopy(_GOOD)


def encode_doc(doc: Any, *, major: int = 1, body: bytes | None = None, crc: int | None = None,
               blen: int | None = None) -> bytes:
    body = json.dumps(doc).encode() if body is None else body
    return struct.pack("<8sHHIQ", b"\xffMMAPMD\n", major, 0, zlib.crc32(body) if crc is None else crc,
                       len(body) if blen is None else blen) + body


def rec(doc: dict[str, Any], fqn: str) -> dict[str, Any]:
    return next(r for r in doc["storage_data"] if r["fqn"] == fqn)


def mutated(f: Callable[[dict[str, Any]], Any]) -> bytes:
    d = good_doc()
    f(d)
    return encode_doc(d)


BAD_METADATA: list[tuple[str, Callable[[], bytes], type, str]] = [
    ("empty", lambda: b"", mmapckpt.BadMagicError, "mmapckpt"),
    ("short", lambda: b"\xffMMAPMD\n\x01", mmapckpt.BadMagicError, "mmapckpt"),
    ("magic", lambda: b"\xffMMAPMX\n" + encode_doc(good_doc())[8:], mmapckpt.BadMagicError, "mmapckpt"),
    ("major-3", lambda: encode_doc(good_doc(), major=3), mmapckpt.UnsupportedVersionError, "version 3"),
    ("length-long", lambda: encode_doc(good_doc(), blen=10**6), mmapckpt.FormatError, "preamble says"),
    ("length-short", lambda: encode_doc(good_doc())[:-5], mmapckpt.FormatError, "preamble says"),
    ("crc", lambda: encode_doc(good_doc(), crc=7), mmapckpt.FormatError, "checksum"),
    ("not-json", lambda: encode_doc(None, body=b"{oops"), mmapckpt.FormatError, "JSON"),
    ("not-utf8", lambda: encode_doc(None, body=b'"\xff"'), mmapckpt.FormatError, "JSON"),
    ("deep", lambda: encode_doc(None, body=b"[" * 50000 + b"]" * 50000), mmapckpt.FormatError, "metadata"),
    ("list", lambda: encode_doc([]), mmapckpt.FormatError, "JSON object"),
    ("sdm-missing", lambda: mutated(lambda d: d.pop("state_dict_metadata")), mmapckpt.FormatError, "state_dict_metadata"),
    ("sdm-list", lambda: mutated(lambda d: d.update(state_dict_metadata=[])), mmapckpt.FormatError, "state_dict_metadata"),
    ("item-type", lambda: mutated(lambda d: d["state_dict_metadata"]["w"].update(type="sparse")), mmapckpt.FormatError, "unknown type"),
    ("item-not-object", lambda: mutated(lambda d: d["state_dict_metadata"].update(w=3)), mmapckpt.FormatError, "'w'"),
    ("dtype", lambda: mutated(lambda d: d["state_dict_metadata"]["w"].update(dtype="float3")), mmapckpt.UnknownDtypeError, "float3"),
    ("size-negative", lambda: mutated(lambda d: d["state_dict_metadata"]["w"].update(size=[-5, 4])), mmapckpt.FormatError, "size"),
    ("size-bool", lambda: mutated(lambda d: d["state_dict_metadata"]["w"].update(size=[True, 4])), mmapckpt.FormatError, "size"),
    ("size-huge", lambda: mutated(lambda d: d["state_dict_metadata"]["w"].update(size=[2**63, 4])), mmapckpt.FormatError, "size"),
    ("chunks-dict", lambda: mutated(lambda d: d["state_dict_metadata"]["w"].update(chunks={})), mmapckpt.FormatError, "chunks"),
    ("chunk-dims", lambda: mutated(lambda d: d["state_dict_metadata"]["w"]["chunks"][0].update(offsets=[0])), mmapckpt.FormatError, "dims"),
    ("chunk-outside", lambda: mutated(lambda d: d["state_dict_metadata"]["w"]["chunks"][0].update(offsets=[1, 0])), mmapckpt.FormatError, "outside"),
    ("planner-data", lambda: mutated(lambda d: d.update(planner_data={"w": "w"})), mmapckpt.FormatError, "planner_data"),
    ("planner-float", lambda: mutated(lambda d: d.update(planner_data={"w": [1.5]})), mmapckpt.FormatError, "planner_data"),
    ("storage-dict", lambda: mutated(lambda d: d.update(storage_data={})), mmapckpt.FormatError, "storage_data"),
    ("record-no-fqn", lambda: mutated(lambda d: rec(d, "w").pop("fqn")), mmapckpt.FormatError, "fqn"),
    ("record-index-bool", lambda: mutated(lambda d: rec(d, "w").update(index=True)), mmapckpt.FormatError, "index"),
    ("record-path-int", lambda: mutated(lambda d: rec(d, "w").update(relative_path=0)), mmapckpt.FormatError, "relative_path"),
    ("record-traversal", lambda: mutated(lambda d: rec(d, "w").update(relative_path="../x")), mmapckpt.UnsafePathError, "'../x'"),
    ("record-absolute", lambda: mutated(lambda d: rec(d, "w").update(relative_path="/tmp/x")), mmapckpt.UnsafePathError, "'/tmp/x'"),
    ("record-nul", lambda: mutated(lambda d: rec(d, "w").update(relative_path="a\0b")), mmapckpt.UnsafePathError, "leaves"),
    ("record-offset-neg", lambda: mutated(lambda d: rec(d, "w").update(file_offset=-64)), mmapckpt.FormatError, "file_offset"),
    ("record-offset-bool", lambda: mutated(lambda d: rec(d, "w").update(file_offset=False)), mmapckpt.FormatError, "file_offset"),
    ("record-length-float", lambda: mutated(lambda d: rec(d, "w").update(length=80.0)), mmapckpt.FormatError, "length"),
    ("record-unknown-item", lambda: mutated(lambda d: rec(d, "w").update(fqn="ghost")), mmapckpt.FormatError, "ghost"),
    ("record-bytes-with-offsets", lambda: mutated(lambda d: rec(d, "txt").update(offset=[0])), mmapckpt.FormatError, "bytes item"),
    ("record-tensor-no-offsets", lambda: mutated(lambda d: rec(d, "w").update(offset=None)), mmapckpt.FormatError, "no chunk offsets"),
    ("record-no-chunk", lambda: mutated(lambda d: rec(d, "w").update(offset=[1, 1])), mmapckpt.FormatError, "matches no chunk"),
    ("record-length", lambda: mutated(lambda d: rec(d, "w").update(length=81)), mmapckpt.FormatError, "holds 80"),
    ("storage-meta-list", lambda: mutated(lambda d: d.update(storage_meta=[])), mmapckpt.FormatError, "storage_meta"),
    ("modules", lambda: mutated(lambda d: d["storage_meta"].update(modules=[1])), mmapckpt.FormatError, "modules"),
    ("save-id-int", lambda: mutated(lambda d: d["storage_meta"].update(save_id=5)), mmapckpt.FormatError, "save_id"),
    ("version-int", lambda: mutated(lambda d: d.update(version=1)), mmapckpt.FormatError, "version"),
]


@pytest.mark.parametrize("make, error, words", [c[1:] for c in BAD_METADATA], ids=[c[0] for c in BAD_METADATA])
def test_malformed_metadata(tmp_path, make: Callable[[], bytes], error: type, words: str) -> None:
    p = tmp_path / ".metadata"
    p.write_bytes(make())
    with pytest.raises(error) as ei:
        read_metadata_file(p)
    err = ei.value
    assert type(err) is error, f"{type(err).__name__}: {err}"
    assert isinstance(err, ValueError) and err.path == str(p) and str(p) in str(err)
    assert words in str(err), str(err)


def test_good_doc_decodes(tmp_path) -> None:
    """The malformed cases above are one change away from a valid file."""
    md = decode_metadata(encode_doc(good_doc()), "m")
    assert set(md.state_dict_metadata) == {"w", "p", "e", "s", "txt", "nested.l.0", "nested.l.1.k"}


# --------------------------------------------------------------------------- stock metadata, restricted unpickler
def test_restricted_unpickler_accepts_real_stock_metadata(tmp_path) -> None:
    ret = stock_metadata(_sd(), str(tmp_path))
    kind, md = read_metadata_file(tmp_path / ".metadata")
    assert kind == "dcp"
    with open(tmp_path / ".metadata", "rb") as f:
        plain = pickle.load(f)  # this test wrote the file itself, so a plain load is safe here
    assert md == plain == ret
    assert_metadata_equal(md, plain)
    assert isinstance(md.storage_meta.checkpoint_id, os.PathLike)  # pathlib objects are admitted


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(sd=state_dicts())
def test_restricted_unpickler_accepts_any_stock_metadata(sd: dict[str, Any]) -> None:
    with tempfile.TemporaryDirectory() as d:
        ret = stock_metadata(sd, d)
        kind, md = read_metadata_file(os.path.join(d, ".metadata"))
        assert kind == "dcp" and md == ret


class _Reduce:
    """Pickles as ``fn(*args)``: what an attacker's metadata file contains."""

    def __init__(self, fn: Any, *args: Any) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return self.fn, self.args


def _payloads(target: str) -> dict[str, bytes]:
    import builtins
    import subprocess

    md = Metadata(state_dict_metadata={"w": BytesStorageMetadata()},
                  storage_data={MetadataIndex("w"): _StorageInfo("__0_0.distcp", 0, 1)})
    inner = copy.copy(md)
    inner.planner_data = {"w": _Reduce(os.system, f"touch {target}")}  # hidden deep inside real metadata
    return {
        "os.system": pickle.dumps(_Reduce(os.system, f"touch {target}"), protocol=2),
        "open": pickle.dumps(_Reduce(builtins.open, target, "w"), protocol=4),
        "popen": pickle.dumps(_Reduce(subprocess.Popen, ["touch", target]), protocol=5),
        "inside-metadata": pickle.dumps(inner, protocol=4),
        "exec": pickle.dumps(_Reduce(builtins.exec, f"open({target!r}, 'w').close()"), protocol=4),
        "torch.save-file": pickle.dumps(_Reduce(torch.save, {}, target), protocol=4),
    }


@pytest.mark.parametrize("name", ["os.system", "open", "popen", "inside-metadata", "exec", "torch.save-file"])
def test_crafted_pickle_is_refused_and_runs_nothing(tmp_path, name: str) -> None:
    target = tmp_path / "pwned"
    meta = tmp_path / ".metadata"
    meta.write_bytes(_payloads(str(target))[name])
    with pytest.raises(mmapckpt.UnsafePickleError) as ei:
        read_metadata_file(meta)
    assert not target.exists()
    assert isinstance(ei.value, mmapckpt.FormatError) and isinstance(ei.value, ValueError)
    assert str(meta) in str(ei.value) and "not a DCP metadata class" in str(ei.value)
    # ... and through the public reader
    with pytest.raises(mmapckpt.UnsafePickleError):
        mmapckpt.MmapReader(tmp_path).read_metadata()
    assert not target.exists()


def test_crafted_payload_is_live(tmp_path) -> None:
    """The payload above does create the file when unpickled plainly: the refusal is what stops it."""
    target = tmp_path / "pwned"
    pickle.loads(_payloads(str(target))["open"]).close()
    assert target.exists()


def test_protocol_0_pickle_is_not_metadata(tmp_path) -> None:
    target = tmp_path / "pwned"
    (tmp_path / ".metadata").write_bytes(pickle.dumps(_Reduce(os.system, f"touch {target}"), protocol=0))
    with pytest.raises(mmapckpt.BadMagicError):
        read_metadata_file(tmp_path / ".metadata")
    assert not target.exists()


def test_persistent_ids_are_refused(tmp_path) -> None:
    import io

    class P(pickle.Pickler):
        def persistent_id(self, obj: Any) -> Any:
            return "x" if isinstance(obj, str) and obj == "w" else None

    buf = io.BytesIO()
    P(buf, protocol=2).dump(Metadata(state_dict_metadata={"w": BytesStorageMetadata()}))
    (tmp_path / ".metadata").write_bytes(buf.getvalue())
    with pytest.raises(mmapckpt.UnsafePickleError, match="persistent"):
        read_metadata_file(tmp_path / ".metadata")


@pytest.mark.parametrize("payload, words", [
    (pickle.dumps({"not": "metadata"}, protocol=2), "Metadata"),
    (pickle.dumps(Metadata(state_dict_metadata={}, storage_data={MetadataIndex("w"): ("a", 0, 1)}), protocol=2), "unexpected types"),
    (pickle.dumps(Metadata(state_dict_metadata={}, storage_data={MetadataIndex("w"): _StorageInfo("a", -1, 1)}), protocol=2), "offset"),
    (pickle.dumps(Metadata(state_dict_metadata={"w": "x"}, storage_data={}), protocol=2), "not a valid DCP item"),
    (pickle.dumps(Metadata(state_dict_metadata={}), protocol=2)[:-10], "pickle"),
    (b"\x80\x02garbage", "pickle"),
], ids=["not-metadata", "record-tuple", "record-negative-offset", "item-str", "truncated", "garbage"])
def test_malformed_stock_metadata(tmp_path, payload: bytes, words: str) -> None:
    (tmp_path / ".metadata").write_bytes(payload)
    with pytest.raises(mmapckpt.FormatError) as ei:
        read_metadata_file(tmp_path / ".metadata")
    assert words in str(ei.value) and str(tmp_path / ".metadata") in str(ei.value)


@pytest.mark.parametrize("rel, ok", [("__0_0.distcp", True), ("sub/x.distcp", True), ("../x", False),
                                     ("/abs", False), ("a/../b", False), ("", False), ("a\\..\\b", False),
                                     ("a//b", False), ("C:\\x" if os.name == "nt" else "\\x", False)])
def test_safe_relative_path(rel: str, ok: bool) -> None:
    if ok:
        assert safe_relative_path(rel, "m") == rel
    else:
        with pytest.raises(mmapckpt.UnsafePathError):
            safe_relative_path(rel, "m")
