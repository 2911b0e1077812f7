"""The shard format's bytes: an exact small case, every malformed preamble and header, layout properties."""

from __future__ import annotations

import json
import struct
import sys
import zlib
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mmapckpt
from mmapckpt.format import layout as fmt
from mmapckpt.reading.shard import Shard
from strategies import ALL_DTYPES, DTYPE_NAMES

from helpers import dcp_save

HOST_ORDER = 1 if sys.byteorder == "little" else 2


# --------------------------------------------------------------------------- building shards by hand
def preamble(hlen: int, hcrc: int, *, magic: bytes = b"MMAPCKPT", major: int = 1, minor: int = 0,
             order: int = HOST_ORDER, reserved: bytes = b"\0\0\0", reserved2: bytes = b"\0\0\0\0") -> bytes:
    """The 32-byte preamble, spelled out field by field (not with format.py)."""
    return (magic + major.to_bytes(2, "little") + minor.to_bytes(2, "little") + bytes([order]) + reserved
            + hlen.to_bytes(8, "little") + hcrc.to_bytes(4, "little") + reserved2)


def shard_bytes(doc: Any, data: dict[int, bytes] | None = None, *, size: int | None = None,
                body: bytes | None = None, **pre: Any) -> bytes:
    """A shard: preamble, the JSON ``doc`` (or raw ``body``), then ``data`` at the given offsets."""
    if body is None:
        body = json.dumps(doc, separators=(",", ":")).encode()
    blob = bytearray(preamble(pre.pop("hlen", len(body)), pre.pop("hcrc", zlib.crc32(body)), **pre) + body)
    for off, chunk in (data or {}).items():
        if len(blob) < off + len(chunk):
            blob.extend(b"\0" * (off + len(chunk) - len(blob)))
        blob[off:off + len(chunk)] = chunk
    if size is not None:
        blob = blob[:size] if size < len(blob) else blob + b"\0" * (size - len(blob))
    return bytes(blob)


def tensor_entry(fqn: str = "w", *, offset: int = 512, length: int = 8, dtype: Any = "float32",
                 shape: Any = (2,), chunk: Any = (0,), crc: Any = "00000000", **extra: Any) -> dict[str, Any]:
    e = {"fqn": fqn, "kind": "tensor", "chunk_offsets": list(chunk) if isinstance(chunk, tuple) else chunk,
         "dtype": dtype, "shape": list(shape) if isinstance(shape, tuple) else shape,
         "offset": offset, "length": length, "crc32": crc}
    e.update(extra)
    return e


def doc(*entries: dict[str, Any]) -> dict[str, Any]:
    return {"format": "mmapckpt", "entries": list(entries)}


def open_blob(tmp_path, blob: bytes, name: str = "__0_0.distcp") -> Shard:
    p = tmp_path / name
    p.write_bytes(blob)
    return Shard(str(p))


# --------------------------------------------------------------------------- exact bytes
def test_exact_bytes_of_a_small_layout() -> None:
    specs = [
        fmt.EntrySpec("a", (0,), "tensor", "int16", (3,), 6),
        fmt.EntrySpec("b", None, "bytes", None, (), 5),
        fmt.EntrySpec("c.w", (4, 0), "tensor", "uint8", (1, 4096), 4096),
    ]
    entries, file_size = fmt.layout_entries(specs, 4096)
    # data start: the 386-byte header below with every offset reserved at 4 digits (no offset of
    # an 8 KiB file has more) is 389 bytes, rounded up to 64: 448; "a" (6 bytes) at 448; "b" at
    # the next multiple of 64; "c.w" (one page) on the next page; the file ends on a page.
    assert [(e.offset, e.length) for e in entries] == [(448, 6), (512, 5), (4096, 4096)]
    assert file_size == 8192
    done = [e._replace(crc32=c) for e, c in zip(entries, (0x0123ABCD, 0, 0xFFFFFFFF))]
    body = (b'{"format":"mmapckpt","entries":['
            b'{"fqn":"a","kind":"tensor","chunk_offsets":[0],"dtype":"int16","shape":[3],"offset":448,"length":6,"crc32":"0123abcd"},'
            b'{"fqn":"b","kind":"bytes","offset":512,"length":5,"crc32":"00000000"},'
            b'{"fqn":"c.w","kind":"tensor","chunk_offsets":[4,0],"dtype":"uint8","shape":[1,4096],"offset":4096,"length":4096,"crc32":"ffffffff"}'
            b']}')
    expected = (b"MMAPCKPT" + b"\x01\x00" + b"\x00\x00" + b"\x01" + b"\x00\x00\x00"
                + struct.pack("<Q", len(body)) + struct.pack("<I", zlib.crc32(body)) + b"\x00" * 4 + body)
    assert fmt.encode_header(done) == expected
    assert len(expected) == 386
    assert fmt.plan_shard(specs, 4096).header([e.crc32 for e in done]) == expected  # the writer's path


def test_exact_bytes_of_a_written_shard(tmp_path) -> None:
    """A whole file from MmapWriter, byte for byte: preamble, header, zero padding, data, zero tail."""
    data = struct.pack("<ff", 1.5, -0.0)
    dcp_save({"w": torch.tensor([1.5, -0.0])}, mmapckpt.MmapWriter(tmp_path))
    save_id = mmapckpt.MmapReader(tmp_path).read_metadata().storage_meta.save_id  # a uuid4 string
    assert isinstance(save_id, str) and len(save_id) == 36
    body = (f'{{"format":"mmapckpt","save_id":"{save_id}","entries":[{{"fqn":"w","kind":"tensor",'
            '"chunk_offsets":[0],"dtype":"float32",'
            f'"shape":[2],"offset":256,"length":8,"crc32":"{zlib.crc32(data):08x}"}}]}}').encode()
    head = preamble(len(body), zlib.crc32(body)) + body
    assert len(head) == 235  # 236 with the offset reserved at 4 digits (a 4 KiB file's), rounded up to 64: 256
    expected = head + b"\0" * (256 - len(head)) + data + b"\0" * (4096 - 264)
    assert (tmp_path / "__0_0.distcp").read_bytes() == expected


def test_header_checksum_and_decode_round_trip(tmp_path) -> None:
    specs = [fmt.EntrySpec(f"t{i}", (0, i), "tensor", "bfloat16", (3, 5), 30) for i in range(4)]
    entries, size = fmt.layout_entries(specs, 4096)
    blob = bytearray(fmt.encode_header(entries))
    blob.extend(b"\0" * (size - len(blob)))
    shard = open_blob(tmp_path, bytes(blob))
    assert shard.header.entries == tuple(entries)
    assert shard.header.data_start == len(fmt.encode_header(entries))
    assert shard.header.byte_order == HOST_ORDER and shard.header.minor == 0


def test_minor_version_and_unknown_keys_are_accepted(tmp_path) -> None:
    """Readers of version 1.x accept newer minors and ignore keys they do not know."""
    d = doc(tensor_entry(extra_field={"x": 1}))
    d["future"] = [1, 2]
    shard = open_blob(tmp_path, shard_bytes(d, {512: b"\1" * 8}, minor=7))
    assert shard.header.minor == 7
    assert [e.fqn for e in shard.header.entries] == ["w"]


# --------------------------------------------------------------------------- malformed preambles
GOOD = doc(tensor_entry())


@pytest.mark.parametrize("blob, error, words", [
    (b"", mmapckpt.TruncatedFileError, "preamble"),
    (b"MMAP", mmapckpt.TruncatedFileError, "preamble"),
    (b"MMAPCKPT\x01\x00", mmapckpt.TruncatedFileError, "preamble"),
    (b"PK\x03\x04", mmapckpt.BadMagicError, "magic"),
    (shard_bytes(GOOD, size=600, magic=b"MMAPCKPX"), mmapckpt.BadMagicError, "magic"),
    (b"\x80\x02" + b"\0" * 100, mmapckpt.BadMagicError, "magic"),
    (shard_bytes(GOOD, size=600, major=2), mmapckpt.UnsupportedVersionError, "version 2"),
    (shard_bytes(GOOD, size=600, major=0), mmapckpt.UnsupportedVersionError, "version 0"),
    (shard_bytes(GOOD, size=600, order=0), mmapckpt.FormatError, "byte-order"),
    (shard_bytes(GOOD, size=600, order=3), mmapckpt.FormatError, "byte-order"),
    (shard_bytes(GOOD, size=600, order=3 - HOST_ORDER), mmapckpt.ByteOrderError, "endian"),
    (shard_bytes(GOOD, size=600, hlen=fmt.MAX_HEADER_SIZE + 1), mmapckpt.FormatError, "limit"),
    (shard_bytes(GOOD, size=600, hlen=2**64 - 1), mmapckpt.FormatError, "limit"),
    (shard_bytes(GOOD, size=600, hlen=10_000), mmapckpt.TruncatedFileError, "past the end"),
    (shard_bytes(GOOD, size=100), mmapckpt.TruncatedFileError, "past the end"),
    (shard_bytes(GOOD, size=600, hcrc=1), mmapckpt.FormatError, "checksum"),
], ids=["empty", "short-magic", "short-preamble", "zip", "bad-magic", "pickle", "major-2", "major-0",
        "order-0", "order-3", "other-endian", "header-too-long", "header-len-u64-max", "header-past-eof",
        "truncated-in-header", "header-crc"])
def test_malformed_preamble(tmp_path, blob: bytes, error: type, words: str) -> None:
    with pytest.raises(error) as ei:
        open_blob(tmp_path, blob)
    assert isinstance(ei.value, mmapckpt.CheckpointError) and isinstance(ei.value, (ValueError, OSError))
    assert "__0_0.distcp" in str(ei.value) and ei.value.path.endswith("__0_0.distcp")
    assert words in str(ei.value)


def test_other_byte_order_is_refused_not_misread(tmp_path) -> None:
    with pytest.raises(mmapckpt.ByteOrderError) as ei:
        open_blob(tmp_path, shard_bytes(GOOD, {512: b"\1" * 8}, order=3 - HOST_ORDER))
    assert isinstance(ei.value, mmapckpt.FormatError) and isinstance(ei.value, ValueError)


def test_preamble_decoder_direct() -> None:
    pre = preamble(100, 0xDEADBEEF, minor=3)
    assert fmt.decode_preamble(pre, 132, "f") == (3, HOST_ORDER, 100, 0xDEADBEEF)
    assert fmt.PREAMBLE_SIZE == 32 and fmt.MAGIC == b"MMAPCKPT" and fmt.MIN_ALIGNMENT == 64
    assert fmt.MAX_HEADER_SIZE == 100 * 1024 * 1024


# --------------------------------------------------------------------------- malformed headers
def _bad_body(body: bytes) -> bytes:
    return shard_bytes(None, body=body, size=len(body) + 4096)


def _bad_doc(d: Any, data: dict[int, bytes] | None = None, size: int = 4096) -> bytes:
    return shard_bytes(d, data, size=size)


HEADER_CASES: list[tuple[str, bytes, type, str | None, str]] = [
    ("not-json", _bad_body(b"{not json"), mmapckpt.FormatError, None, "JSON"),
    ("not-utf8", _bad_body(b'{"format":"\xff\xfe"}'), mmapckpt.FormatError, None, "JSON"),
    ("deep-nesting", _bad_body(b"[" * 100_000 + b"]" * 100_000), mmapckpt.FormatError, None, "JSON"),
    ("json-list", _bad_doc([1, 2]), mmapckpt.FormatError, None, "header object"),
    ("no-format", _bad_doc({"entries": []}), mmapckpt.FormatError, None, "header object"),
    ("wrong-format", _bad_doc({"format": "safetensors", "entries": []}), mmapckpt.FormatError, None, "header object"),
    ("entries-not-list", _bad_doc({"format": "mmapckpt", "entries": {}}), mmapckpt.FormatError, None, "entries"),
    ("entry-not-object", _bad_doc(doc([1])), mmapckpt.FormatError, None, "not an object"),
    ("fqn-missing", _bad_doc(doc({k: v for k, v in tensor_entry().items() if k != "fqn"})), mmapckpt.FormatError, None, "fqn"),
    ("fqn-int", _bad_doc(doc(tensor_entry(fqn=3))), mmapckpt.FormatError, None, "fqn"),
    ("crc-uppercase", _bad_doc(doc(tensor_entry(crc="ABCDEF01"))), mmapckpt.FormatError, "w", "crc32"),
    ("crc-short", _bad_doc(doc(tensor_entry(crc="abc"))), mmapckpt.FormatError, "w", "crc32"),
    ("crc-int", _bad_doc(doc(tensor_entry(crc=0))), mmapckpt.FormatError, "w", "crc32"),
    ("offset-bool", _bad_doc(doc(tensor_entry(offset=True))), mmapckpt.FormatError, "w", "offset"),
    ("offset-float", _bad_doc(doc(tensor_entry(offset=512.0))), mmapckpt.FormatError, "w", "offset"),
    ("offset-str", _bad_doc(doc(tensor_entry(offset="512"))), mmapckpt.FormatError, "w", "offset"),
    ("offset-negative", _bad_doc(doc(tensor_entry(offset=-64))), mmapckpt.FormatError, "w", "offset"),
    ("offset-in-preamble", _bad_doc(doc(tensor_entry(offset=0))), mmapckpt.FormatError, "w", "offset"),
    ("length-bool", _bad_doc(doc(tensor_entry(length=False, shape=(0,)))), mmapckpt.FormatError, "w", "length"),
    ("length-negative", _bad_doc(doc(tensor_entry(length=-8))), mmapckpt.FormatError, "w", "length"),
    ("length-null", _bad_doc(doc(tensor_entry(length=None))), mmapckpt.FormatError, "w", "length"),
    ("kind-unknown", _bad_doc(doc(tensor_entry(kind="sparse"))), mmapckpt.FormatError, "w", "kind"),
    ("kind-missing", _bad_doc(doc({k: v for k, v in tensor_entry().items() if k != "kind"})), mmapckpt.FormatError, "w", "kind"),
    ("chunk-missing", _bad_doc(doc(tensor_entry(chunk=None))), mmapckpt.FormatError, "w", "chunk_offsets"),
    ("chunk-bool", _bad_doc(doc(tensor_entry(chunk=[True]))), mmapckpt.FormatError, "w", "chunk_offsets"),
    ("chunk-negative", _bad_doc(doc(tensor_entry(chunk=[-1]))), mmapckpt.FormatError, "w", "chunk_offsets"),
    ("shape-not-list", _bad_doc(doc(tensor_entry(shape=2))), mmapckpt.FormatError, "w@[0]", "shape"),
    ("shape-bool", _bad_doc(doc(tensor_entry(shape=[True, True], chunk=[0, 0], length=4))), mmapckpt.FormatError, "w@[0, 0]", "shape"),
    ("shape-float", _bad_doc(doc(tensor_entry(shape=[2.0]))), mmapckpt.FormatError, "w@[0]", "shape"),
    ("shape-negative", _bad_doc(doc(tensor_entry(shape=[-2], length=8))), mmapckpt.FormatError, "w@[0]", "shape"),
    ("too-many-dims", _bad_doc(doc(tensor_entry(shape=[1] * 65, chunk=[0] * 65, length=4))), mmapckpt.FormatError, "w", "at most 64"),
    ("rank-mismatch", _bad_doc(doc(tensor_entry(shape=[2, 1]))), mmapckpt.FormatError, "w@[0]", "dims"),
    ("dtype-unknown", _bad_doc(doc(tensor_entry(dtype="float128"))), mmapckpt.UnknownDtypeError, "w@[0]", "float128"),
    ("dtype-torch-spelling", _bad_doc(doc(tensor_entry(dtype="torch.float32"))), mmapckpt.UnknownDtypeError, "w@[0]", "dtype"),
    ("dtype-null", _bad_doc(doc(tensor_entry(dtype=None))), mmapckpt.UnknownDtypeError, "w@[0]", "dtype"),
    ("dtype-int", _bad_doc(doc(tensor_entry(dtype=6))), mmapckpt.UnknownDtypeError, "w@[0]", "dtype"),
    ("length-vs-shape", _bad_doc(doc(tensor_entry(length=12))), mmapckpt.FormatError, "w@[0]", "does not match shape"),
    ("length-vs-itemsize", _bad_doc(doc(tensor_entry(dtype="float64"))), mmapckpt.FormatError, "w@[0]", "does not match shape"),
    ("misaligned", _bad_doc(doc(tensor_entry(offset=520))), mmapckpt.EntryBoundsError, "w@[0]", "multiple of 64"),
    ("misaligned-32", _bad_doc(doc(tensor_entry(offset=544))), mmapckpt.EntryBoundsError, "w@[0]", "multiple of 64"),
    ("past-eof", _bad_doc(doc(tensor_entry(offset=4096)), size=4096), mmapckpt.TruncatedFileError, "w@[0]", "past the end"),
    ("straddles-eof", _bad_doc(doc(tensor_entry(offset=4032, length=80, shape=(20,))), size=4096), mmapckpt.TruncatedFileError, "w@[0]", "past the end"),
    ("huge-offset", _bad_doc(doc(tensor_entry(offset=2**62))), mmapckpt.TruncatedFileError, "w@[0]", "past the end"),
    ("huge-length", _bad_doc(doc(tensor_entry(length=2**62, shape=(2**60,)))), mmapckpt.TruncatedFileError, "w@[0]", "past the end"),
    ("overlaps-header", _bad_doc(doc(tensor_entry(offset=64))), mmapckpt.EntryBoundsError, "w@[0]", "overlaps the header"),
    ("overlap", _bad_doc(doc(tensor_entry("a", offset=512, length=128, shape=(32,)), tensor_entry("b", offset=576))),
     mmapckpt.EntryBoundsError, "b@[0]", "overlaps entry 'a@[0]'"),
    # the same bytes under two names are an exact alias (tied weights) only with equal CRC, dtype and shape
    ("same-offset", _bad_doc(doc(tensor_entry("a"), tensor_entry("b", crc="00000001"))), mmapckpt.EntryBoundsError, "@[0]", "overlaps"),
    ("same-offset-dtype", _bad_doc(doc(tensor_entry("a"), tensor_entry("b", dtype="int32"))), mmapckpt.EntryBoundsError, "@[0]", "overlaps"),
    ("same-offset-shape", _bad_doc(doc(tensor_entry("a", shape=(2, 1), chunk=(0, 0)), tensor_entry("b", shape=(2,)))),
     mmapckpt.EntryBoundsError, "@[0", "overlaps"),
    ("bytes-overlap", _bad_doc(doc(tensor_entry("a"), {"fqn": "s", "kind": "bytes", "offset": 514, "length": 3, "crc32": "00000000"})),
     mmapckpt.EntryBoundsError, None, "overlaps"),
    ("offset-2**63", _bad_doc(doc(tensor_entry(offset=2**63))), mmapckpt.FormatError, "w", "offset"),
    ("dim-2**63", _bad_doc(doc(tensor_entry(shape=[2**63], length=8))), mmapckpt.FormatError, "w@[0]", "shape"),
    ("save-id-int", _bad_doc({"format": "mmapckpt", "save_id": 5, "entries": []}), mmapckpt.FormatError, None, "save_id"),
    ("save-id-long", _bad_doc({"format": "mmapckpt", "save_id": "x" * 257, "entries": []}), mmapckpt.FormatError, None, "save_id"),
    ("duplicate", _bad_doc(doc(tensor_entry("a"), tensor_entry("a", offset=576))), mmapckpt.EntryBoundsError, "a@[0]", "duplicate"),
    ("duplicate-empty", _bad_doc(doc(tensor_entry("a", length=0, shape=(0,)), tensor_entry("a", length=0, shape=(0,), offset=576))),
     mmapckpt.EntryBoundsError, "a@[0]", "duplicate"),
]


@pytest.mark.parametrize("blob, error, entry, words", [c[1:] for c in HEADER_CASES], ids=[c[0] for c in HEADER_CASES])
def test_malformed_header(tmp_path, blob: bytes, error: type, entry: str | None, words: str) -> None:
    with pytest.raises(error) as ei:
        open_blob(tmp_path, blob)
    err = ei.value
    assert type(err) is error, f"{type(err).__name__}: {err}"
    assert isinstance(err, ValueError)
    assert err.path.endswith("__0_0.distcp") and "__0_0.distcp" in str(err)
    if entry is not None:
        assert err.entry is not None and entry in err.entry and repr(err.entry) in str(err)
    assert words in str(err), str(err)


def test_good_variants_of_the_cases_above_are_accepted(tmp_path) -> None:
    """The malformed cases differ from valid headers only in the broken field."""
    ok = [
        doc(tensor_entry()),
        doc(tensor_entry("a", length=0, shape=(0,)), tensor_entry("b", length=0, shape=(3, 0), chunk=(0, 0), offset=512)),
        doc(tensor_entry("a", offset=512, length=64, shape=(16,)), tensor_entry("b", offset=576)),
        doc(tensor_entry("a"), tensor_entry("a", chunk=(2,), offset=576)),  # same fqn, other chunk
        doc(tensor_entry("a"), {"fqn": "a", "kind": "bytes", "offset": 4000, "length": 3, "crc32": "00000000"}),
        doc(tensor_entry(shape=(), chunk=(), length=4, dtype="int32")),
        doc(tensor_entry(shape=[1] * 64, chunk=[0] * 64, length=4)),
        doc(),
    ]
    for i, d in enumerate(ok):
        shard = open_blob(tmp_path, _bad_doc(d), name=f"ok{i}.distcp")
        assert len(shard.header.entries) == len(d["entries"])


def test_zero_size_file_entries_map_nothing(tmp_path) -> None:
    shard = open_blob(tmp_path, shard_bytes(doc(tensor_entry(length=0, shape=(0, 2), chunk=(0, 0), offset=128))))
    [e] = shard.header.entries
    t = shard.tensor(e)
    assert t.shape == (0, 2) and t.dtype == torch.float32


def test_view_reads_the_entry_bytes(tmp_path) -> None:
    raw = struct.pack("<4h", 1, -2, 3, -32768)
    shard = open_blob(tmp_path, shard_bytes(doc(tensor_entry(dtype="int16", shape=(2, 2), chunk=(0, 0), length=8,
                                                             crc=f"{zlib.crc32(raw):08x}")), {512: raw}, size=600))
    [e] = shard.header.entries
    assert shard.tensor(e).tolist() == [[1, -2], [3, -32768]]
    shard.verify(e)


def test_checksum_mismatch(tmp_path) -> None:
    shard = open_blob(tmp_path, shard_bytes(doc(tensor_entry(crc="00000001")), {512: b"\1" * 8}))
    with pytest.raises(mmapckpt.ChecksumError) as ei:
        shard.verify(shard.header.entries[0])
    assert "w@[0]" in str(ei.value) and "__0_0.distcp" in str(ei.value)


# --------------------------------------------------------------------------- dtype table
def test_dtype_table_covers_every_dtype() -> None:
    assert set(fmt.DTYPES) == {n for n in DTYPE_NAMES if isinstance(getattr(torch, n, None), torch.dtype)}
    for dt in ALL_DTYPES:
        name = fmt.dtype_name(dt)
        assert fmt.dtype_from_name(name) is dt
        assert fmt.DTYPES[name] == (dt, dt.itemsize)
        assert name == str(dt).removeprefix("torch.")


@pytest.mark.parametrize("dtype", [getattr(torch, n) for n in ("quint8", "qint32", "uint1", "int4")
                                   if isinstance(getattr(torch, n, None), torch.dtype)])
def test_dtype_name_refuses_other_dtypes(dtype: torch.dtype) -> None:
    with pytest.raises(ValueError):
        fmt.dtype_name(dtype)


@pytest.mark.parametrize("name", ["float128", "Float32", "", "torch.int8", None, 4, ["float32"]])
def test_dtype_from_name_refuses_unknown(name: Any) -> None:
    with pytest.raises(mmapckpt.UnknownDtypeError) as ei:
        fmt.dtype_from_name(name, path="p", entry="e")
    assert "p" in str(ei.value) and "'e'" in str(ei.value)


# --------------------------------------------------------------------------- layout properties
_specs = st.lists(
    st.one_of(
        st.builds(lambda n, fqn: fmt.EntrySpec(fqn, (0,), "tensor", "uint8", (n,), n),
                  st.one_of(st.integers(0, 200), st.integers(4000, 20000)), st.text(max_size=40)),
        st.builds(lambda n, fqn: fmt.EntrySpec(fqn, None, "bytes", None, (), n), st.integers(0, 300), st.text(max_size=40)),
    ),
    max_size=40,
    unique_by=lambda s: (s.fqn, s.kind),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs=_specs, alignment=st.sampled_from([64, 128, 4096, 65536]))
def test_layout_entries_properties(tmp_path_factory, specs: list[fmt.EntrySpec], alignment: int) -> None:
    entries, size = fmt.layout_entries(specs, alignment)
    header = fmt.encode_header(entries)
    assert [(e.fqn, e.kind, e.length) for e in entries] == [(s.fqn, s.kind, s.length) for s in specs]
    pos = len(header)
    for i, e in enumerate(entries):
        assert e.offset >= pos, "entries are in plan order, after the header, not overlapping"
        assert e.offset % 64 == 0
        need = alignment if e.length >= alignment else 64
        assert e.offset % need == 0
        if i:
            assert e.offset - pos < need, "no more padding than the alignment needs"
        pos = e.offset + e.length
    assert size >= pos and size % alignment == 0
    if entries:
        assert size - pos < alignment, "the file ends on the first alignment boundary after the data"
    assert fmt.layout_entries(specs, alignment) == (entries, size)  # deterministic
    # What the layout describes is a valid file.
    p = tmp_path_factory.mktemp("layout") / "s.distcp"
    p.write_bytes(header + b"\0" * (size - len(header)))
    assert Shard(str(p)).header.entries == tuple(entries)


@pytest.mark.parametrize("alignment", [0, 1, 32, 63, 96, 4095, -4096])
def test_layout_refuses_bad_alignment(alignment: int) -> None:
    with pytest.raises(ValueError):
        fmt.layout_entries([], alignment)


def test_layout_grows_the_header_area_for_long_names() -> None:
    """The first guess at the header's size is too small for long names; the layout iterates."""
    specs = [fmt.EntrySpec("x" * 500 + str(i), (0,), "tensor", "uint8", (1,), 1) for i in range(20)]
    entries, _ = fmt.layout_entries(specs, 4096)
    assert entries[0].offset >= len(fmt.encode_header(entries))
    assert entries[0].offset > 32 + 256 + 160 * 20
