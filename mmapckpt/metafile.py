"""The checkpoint metadata file (``.metadata``): encoding without pickle, and safe reading.

An mmapckpt ``.metadata`` file is::

    offset 0   magic     8 bytes  b"\\xffMMAPMD\\n"   (0xff is no pickle opcode: the stock
                                                     reader fails at once, running nothing)
    offset 8   major     u16      1
    offset 10  minor     u16      0
    offset 12  body_crc  u32      CRC-32 (zlib) of the body
    offset 16  body_len  u64
    offset 24  body      UTF-8 JSON encoding of torch's DCP ``Metadata`` (see docs/format.md)

Decoding validates the JSON once, into the index of entries (``_entries.EntryInfo``)
that the lazy loader uses as it is; DCP's ``Metadata`` objects are built from that
index only for ``dcp.load``. Stock DCP checkpoints keep a pickled ``Metadata``,
read by _stockmeta.py without running code.
"""

from __future__ import annotations

import json
import math
import os
import struct
import zlib
from typing import Any, NamedTuple

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from . import format as fmt
from ._entries import ChunkInfo, EntryInfo, paused_gc
from ._io import safe_relative_path
from ._stockmeta import decode_stock, stock_index
from .errors import BadMagicError, FormatError, UnsupportedVersionError

__all__ = [
    "METADATA_NAME",
    "META_MAGIC",
    "encode_metadata",
    "MetaIndex",
    "decode_index",
    "decode_metadata",
    "read_metadata_file",
    "read_index_file",
    "metadata_kind",
    "safe_relative_path",
]

METADATA_NAME = ".metadata"
META_MAGIC = b"\xffMMAPMD\n"
META_MAJOR = 1
META_MINOR = 0
_META_PRE = struct.Struct("<8sHHIQ")
#: A metadata file larger than this is refused before it is read.
MAX_METADATA_SIZE = 1 << 30
KIND_MMAPCKPT = "mmapckpt"
KIND_STOCK = "dcp"


# --------------------------------------------------------------------------- encoding
def _enc_planner_data(pd: Any) -> Any:
    if pd is None:
        return None
    ok = isinstance(pd, dict) and all(
        isinstance(k, str) and isinstance(v, (tuple, list)) and all(type(p) in (str, int) for p in v)
        for k, v in pd.items()
    )
    if not ok:
        raise TypeError(
            "mmapckpt stores only the default planners' planner_data ({fqn: path of str/int keys}); "
            f"got {type(pd).__name__}, which could not be stored without pickle"
        )
    return {k: list(v) for k, v in pd.items()}


def _enc_item(md: Any) -> dict[str, Any]:
    if isinstance(md, BytesStorageMetadata):
        return {"type": "bytes"}
    return {
        "type": "tensor",
        "dtype": fmt.dtype_name(md.properties.dtype),
        "requires_grad": bool(md.properties.requires_grad),
        "size": list(md.size),
        "chunks": [{"offsets": list(c.offsets), "sizes": list(c.sizes)} for c in md.chunks],
    }


def _canonical_records(md: Metadata) -> list[tuple[MetadataIndex, Any]]:
    """Storage records in the order of the items and chunks they store, so that encoding is canonical."""
    rank: dict[tuple[str, Any], int] = {}
    for fqn, item in md.state_dict_metadata.items():
        for c in getattr(item, "chunks", None) or [None]:
            rank[(fqn, None if c is None else tuple(c.offsets))] = len(rank)
    return sorted((md.storage_data or {}).items(), key=lambda kv: rank.get(
        (kv[0].fqn, None if kv[0].offset is None else tuple(kv[0].offset)), len(rank)))


def encode_metadata(md: Metadata) -> bytes:
    """Encode DCP ``Metadata`` whose storage_data values are ``_StorageInfo`` records."""
    storage = []
    for idx, info in _canonical_records(md):
        if getattr(info, "transform_descriptors", None):
            raise TypeError("mmapckpt does not support stream transforms in storage data")
        storage.append({
            "fqn": idx.fqn,
            "offset": None if idx.offset is None else list(idx.offset),
            "index": idx.index,
            "relative_path": info.relative_path,
            "file_offset": info.offset,
            "length": info.length,
        })
    sm = md.storage_meta
    doc = {
        "version": md.version,
        "state_dict_metadata": {k: _enc_item(v) for k, v in md.state_dict_metadata.items()},
        "planner_data": _enc_planner_data(md.planner_data),
        "storage_data": storage,
        "storage_meta": None if sm is None else {
            "checkpoint_id": None if sm.checkpoint_id is None else os.fspath(sm.checkpoint_id),
            "save_id": sm.save_id,
            "modules": list(sm.modules),
        },
    }
    body = json.dumps(doc, separators=(",", ":"), ensure_ascii=True).encode("ascii")
    return _META_PRE.pack(META_MAGIC, META_MAJOR, META_MINOR, zlib.crc32(body), len(body)) + body


# --------------------------------------------------------------------------- decoding
class _Bad(Exception):
    pass


def _need(cond: bool, what: str) -> None:
    if not cond:
        raise _Bad(what)


def _dims(v: Any, what: str, fqn: str) -> tuple[int, ...]:
    """A JSON list of at most MAX_NDIM integers in [0, 2**63), as a tuple (messages are built on failure only)."""
    if type(v) is list and len(v) <= fmt.MAX_NDIM:
        for x in v:
            if type(x) is not int:  # bool is an int subclass: refused too
                break
        else:
            if not v or (min(v) >= 0 and max(v) <= fmt.MAX_INT):
                return tuple(v)
    raise _Bad(f"{what} of {fqn!r} must be a list of integers in [0, 2**63)")


def _opt_str(v: Any, what: str) -> str | None:
    _need(v is None or isinstance(v, str), f"{what} must be a string or null")
    return v


class MetaIndex(NamedTuple):
    """A validated mmapckpt ``.metadata``: the entries, and what DCP's ``Metadata`` also carries."""

    entries: dict[str, EntryInfo]
    save_id: str | None
    doc: dict[str, Any]  # the JSON document, for planner_data, storage_meta and version
    requires_grad: set[str]
    record_index: dict[tuple[str, tuple[int, ...] | None], int]  # MetadataIndex.index hints


_Record = tuple  # (relative_path, file_offset, length)


def _records(raw: Any, path: str, record_index: dict[Any, int]) -> dict[tuple[str, Any], _Record]:
    """The storage records by (fqn, chunk offsets or None)."""
    _need(type(raw) is list, "'storage_data' must be a list")
    recs: dict[tuple[str, Any], _Record] = {}
    rels: set[str] = set()
    for r in raw:
        if type(r) is not dict or type(r.get("fqn")) is not str:
            raise _Bad("a storage record needs a string 'fqn'")
        fqn, off, index = r["fqn"], r.get("offset"), r.get("index")
        key = (fqn, None if off is None else _dims(off, "offset", fqn))
        if index is not None:
            if type(index) is not int or index < 0:
                raise _Bad("a storage record's 'index' must be an integer")
            record_index[key] = index
        rel = r.get("relative_path")
        if type(rel) is not str:
            raise _Bad(f"storage record of {fqn!r} needs a string 'relative_path'")
        if rel not in rels:
            rels.add(safe_relative_path(rel, path))
        fo, ln = r.get("file_offset"), r.get("length")
        if not (type(fo) is int and type(ln) is int and 0 <= fo <= fmt.MAX_INT and 0 <= ln <= fmt.MAX_INT):
            raise _Bad(f"storage record of {fqn!r} needs integer 'file_offset' and 'length' in [0, 2**63)")
        recs[key] = (rel, fo, ln)
    return recs


def _tensor_chunks(fqn: str, v: dict[str, Any], size: tuple[int, ...], itemsize: int,
                   recs: dict[tuple[str, Any], _Record], missing: list[str]) -> tuple[ChunkInfo, ...]:
    raw = v.get("chunks")
    if type(raw) is not list:
        raise _Bad(f"chunks of {fqn!r} must be a list")
    chunks = []
    whole = list(size)
    for c in raw:
        if type(c) is not dict:
            raise _Bad(f"a chunk of {fqn!r} must be an object")
        off, sz = c.get("offsets"), c.get("sizes")
        if sz == whole and type(off) is list and len(off) == len(size) and not any(off):
            off, sz = (0,) * len(size), size  # the whole tensor (the common case): equal to checked values
        else:
            off, sz = _dims(off, "chunk offsets", fqn), _dims(sz, "chunk sizes", fqn)
        if not len(off) == len(sz) == len(size):
            raise _Bad(f"a chunk of {fqn!r} has the wrong number of dims")
        n = itemsize
        for o, s, g in zip(off, sz, size):
            if o + s > g:
                raise _Bad(f"a chunk of {fqn!r} lies outside the tensor")
            n *= s
        rec = recs.pop((fqn, off), None)
        if rec is None:
            missing.append(f"{fqn}@{list(off)}")
            continue
        if rec[2] != n:
            raise _Bad(f"storage record of {fqn!r}@{list(off)} is {rec[2]} bytes, its chunk holds {n}")
        chunks.append(ChunkInfo(off, sz, *rec))
    held, whole_n = sum(math.prod(c.sizes) for c in chunks), math.prod(size)
    if held < whole_n and not missing:  # a part stored nowhere would load as whatever the target held
        raise _Bad(f"the chunks of {fqn!r} hold {held} of its {whole_n} elements")
    return tuple(chunks)


def _whole_chunk(fqn: str, v: dict[str, Any], size_raw: list[Any], size: tuple[int, ...], itemsize: int,
                 recs: dict[tuple[str, Any], _Record]) -> tuple[ChunkInfo, ...] | None:
    """The common case, checked in a few steps: one chunk, the whole tensor, its record of the right length.

    None (nothing consumed) for anything else, which :func:`_tensor_chunks` then checks in full.
    """
    raw = v.get("chunks")
    if type(raw) is not list or len(raw) != 1 or type(raw[0]) is not dict:
        return None
    off = raw[0].get("offsets")
    if raw[0].get("sizes") != size_raw or type(off) is not list or len(off) != len(size) or any(off):
        return None
    zeros = (0,) * len(size)
    rec = recs.get((fqn, zeros))
    if rec is None or rec[2] != math.prod(size) * itemsize:
        return None
    del recs[(fqn, zeros)]
    return (ChunkInfo(zeros, size, *rec),)


def _index_doc(doc: Any, path: str) -> MetaIndex:
    _need(type(doc) is dict, "metadata must be a JSON object")
    sdm = doc.get("state_dict_metadata")
    _need(type(sdm) is dict, "'state_dict_metadata' must be an object")
    record_index: dict[Any, int] = {}
    recs = _records(doc.get("storage_data"), path, record_index)
    entries: dict[str, EntryInfo] = {}
    grad: set[str] = set()
    missing: list[str] = []
    for fqn, v in sdm.items():
        if type(v) is not dict:
            raise _Bad(f"state_dict_metadata[{fqn!r}] must be an object")
        kind = v.get("type")
        if kind == "bytes":
            rec = recs.pop((fqn, None), None)
            if rec is None:
                missing.append(fqn)
                continue
            entries[fqn] = EntryInfo(fqn, "object", None, None, (ChunkInfo((), (), *rec),))
            continue
        if kind != "tensor":
            raise _Bad(f"state_dict_metadata[{fqn!r}] has an unknown type")
        name = v.get("dtype")
        dt = fmt.DTYPES.get(name) if type(name) is str else None
        if dt is None:
            fmt.dtype_from_name(name, path=path, entry=fqn)  # raises UnknownDtypeError
        size_raw = v.get("size")
        size = _dims(size_raw, "size", fqn)
        chunks = _whole_chunk(fqn, v, size_raw, size, dt[1], recs)
        if chunks is None:
            chunks = _tensor_chunks(fqn, v, size, dt[1], recs, missing)
        entries[fqn] = EntryInfo(fqn, "tensor", dt[0], size, chunks)
        if v.get("requires_grad"):
            grad.add(fqn)
    for fqn, off in recs:  # records left over belong to nothing described
        item = sdm.get(fqn)
        if item is None:
            raise _Bad(f"storage record of {fqn!r} names no item of the state dict")
        if item.get("type") == "bytes":
            raise _Bad(f"storage record of bytes item {fqn!r} has chunk offsets")
        if off is None:
            raise _Bad(f"storage record of tensor {fqn!r} has no chunk offsets")
        raise _Bad(f"storage record of {fqn!r}@{list(off)} matches no chunk")
    if missing:
        raise FormatError("metadata has no storage record for this entry", path=path, entry=missing[0])
    sm = doc.get("storage_meta")
    _need(sm is None or type(sm) is dict, "'storage_meta' must be an object")
    save_id = None if sm is None else _opt_str(sm.get("save_id"), "save_id")
    return MetaIndex(entries, save_id, doc, grad, record_index)


def _planner_data(raw: Any) -> dict[str, tuple[Any, ...]] | None:
    if raw is None:
        return None
    _need(type(raw) is dict, "'planner_data' must be an object")
    for v in raw.values():
        _need(type(v) is list and all(type(p) in (str, int) for p in v), "planner_data paths must be lists")
    return {k: tuple(v) for k, v in raw.items()}


def _storage_meta(raw: Any) -> StorageMeta | None:
    if raw is None:
        return None
    mods = raw.get("modules", [])
    _need(type(mods) is list and all(isinstance(m, str) for m in mods), "'modules' must be strings")
    return StorageMeta(checkpoint_id=_opt_str(raw.get("checkpoint_id"), "checkpoint_id"),
                       save_id=_opt_str(raw.get("save_id"), "save_id"), modules=list(mods))


def _to_dcp(ix: MetaIndex) -> Metadata:
    """DCP's ``Metadata`` for an index (what ``dcp.load`` plans with)."""
    sdm: dict[str, Any] = {}
    storage: dict[MetadataIndex, _StorageInfo] = {}
    for name, e in ix.entries.items():
        if e.kind == "object":
            sdm[name] = BytesStorageMetadata()
            c = e.chunks[0]
            storage[MetadataIndex(name, None, ix.record_index.get((name, None)))] = _StorageInfo(
                c.file, c.file_offset, c.length)
            continue
        props = TensorProperties(dtype=e.dtype, requires_grad=name in ix.requires_grad)
        sdm[name] = TensorStorageMetadata(props, torch.Size(e.shape), [
            ChunkStorageMetadata(offsets=torch.Size(c.offsets), sizes=torch.Size(c.sizes)) for c in e.chunks])
        for c in e.chunks:
            storage[MetadataIndex(name, c.offsets, ix.record_index.get((name, c.offsets)))] = _StorageInfo(
                c.file, c.file_offset, c.length)
    return Metadata(state_dict_metadata=sdm, planner_data=_planner_data(ix.doc.get("planner_data")),
                    storage_data=storage, storage_meta=_storage_meta(ix.doc.get("storage_meta")),
                    version=_opt_str(ix.doc.get("version"), "version"))


def _body(data: bytes, path: str) -> bytes:
    if len(data) < _META_PRE.size or data[:8] != META_MAGIC:
        raise BadMagicError("not an mmapckpt metadata file", path=path)
    _, major, _minor, crc, blen = _META_PRE.unpack_from(data)
    if major != META_MAJOR:
        raise UnsupportedVersionError(f"metadata version {major}; this mmapckpt reads {META_MAJOR}.x", path=path)
    body = data[_META_PRE.size:]
    if len(body) != blen:
        raise FormatError(f"metadata body is {len(body)} bytes, its preamble says {blen}", path=path)
    if zlib.crc32(body) != crc:
        raise FormatError("metadata checksum mismatch: the file is damaged", path=path)
    return body


def _decoding(data: bytes, path: str, build: Any) -> Any:
    body = _body(data, path)
    try:
        with paused_gc():
            doc = json.loads(body.decode("utf-8"))
            out = build(_index_doc(doc, path))
            del doc  # freed before the collector resumes, so that it never walks the document
        return out
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        if isinstance(e, FormatError):
            raise
        raise FormatError(f"metadata is not valid JSON: {e}", path=path) from None
    except _Bad as e:
        raise FormatError(f"invalid metadata: {e}", path=path) from None


def decode_index(data: bytes, path: str) -> MetaIndex:
    """Decode an mmapckpt ``.metadata`` file's bytes into its index; every defect raises FormatError."""
    return _decoding(data, path, lambda ix: ix)


def decode_metadata(data: bytes, path: str) -> Metadata:
    """Decode an mmapckpt ``.metadata`` file's bytes into DCP ``Metadata``; every defect raises FormatError."""
    return _decoding(data, path, _to_dcp)


def metadata_kind(head: bytes) -> str | None:
    """Which kind of checkpoint a metadata file's first bytes announce, if any."""
    if head.startswith(META_MAGIC):
        return KIND_MMAPCKPT
    if head[:1] == b"\x80":  # pickle protocol 2+
        return KIND_STOCK
    return None


def _read(path: str | os.PathLike[str]) -> tuple[str, str, bytes]:
    p = os.fspath(path)
    with open(p, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size > MAX_METADATA_SIZE:
            raise FormatError(f"metadata file of {size} bytes exceeds the limit of {MAX_METADATA_SIZE}", path=p)
        data = f.read(size)  # not read(MAX_METADATA_SIZE + 1): that allocates the full 1 GiB up front
    kind = metadata_kind(data[:8])
    if kind is None:
        raise BadMagicError("neither mmapckpt nor stock DCP metadata (unknown leading bytes)", path=p)
    return p, kind, data


def read_metadata_file(path: str | os.PathLike[str]) -> tuple[str, Metadata]:
    """Read a ``.metadata`` file of either kind; return (kind, DCP Metadata)."""
    p, kind, data = _read(path)
    return kind, (decode_metadata(data, p) if kind == KIND_MMAPCKPT else decode_stock(data, p))


def read_index_file(path: str | os.PathLike[str]) -> tuple[str, dict[str, EntryInfo], str | None]:
    """Read a ``.metadata`` file of either kind; return (kind, entries by name, save id)."""
    p, kind, data = _read(path)
    if kind == KIND_MMAPCKPT:
        return (kind, *_decoding(data, p, lambda ix: (ix.entries, ix.save_id)))
    md = decode_stock(data, p)
    return kind, stock_index(md, p), getattr(md.storage_meta, "save_id", None)
