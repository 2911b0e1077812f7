"""Version 1 of the ``.metadata`` body: one JSON object per item and per storage record.

What mmapckpt wrote before the entry table (v2.py); still read, and written by
``encode_metadata(md, major=1)``. Its body (docs/format.md, section 3.2)::

    {"version": ..., "state_dict_metadata": {fqn: {"type": "bytes"} | {"type": "tensor", "dtype",
     "requires_grad", "size", "chunks": [{"offsets", "sizes"}, ...]}, ...},
     "planner_data": {fqn: path, ...} | null, "storage_data": [{"fqn", "offset", "index",
     "relative_path", "file_offset", "length"[, "transform_descriptors"]}, ...], "storage_meta": ...}

:func:`decode` checks it in one pass into the index (index.py) and ends in
``tiling.check_entries``, as every decoder does.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from ...errors import FormatError
from .. import layout as fmt
from ..entries import ChunkInfo, EntryInfo, safe_relative_path
from ..tiling import check_entries
from .index import InvalidMetadata, MetaIndex, need, top_fields

if TYPE_CHECKING:  # the encoder reads DCP objects a caller built; decoding needs none
    from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

__all__ = ["encode", "decode", "planner_data"]


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
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata  # loaded already: md is DCP's

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


def _enc_records(md: Metadata) -> list[dict[str, Any]]:
    storage = []
    for idx, info in _canonical_records(md):
        rec = {
            "fqn": idx.fqn,
            "offset": None if idx.offset is None else list(idx.offset),
            "index": idx.index,
            "relative_path": info.relative_path,
            "file_offset": info.offset,
            "length": info.length,
        }
        if getattr(info, "transform_descriptors", None):  # stored encoded: MmapWriter(_extensions=...)
            rec["transform_descriptors"] = [str(d) for d in info.transform_descriptors]
        storage.append(rec)
    return storage


def encode(md: Metadata) -> dict[str, Any]:
    """The version-1 body's fields that describe the entries, of DCP ``Metadata`` whose storage_data
    values are ``_StorageInfo`` records (in the body's key order)."""
    return {"state_dict_metadata": {k: _enc_item(v) for k, v in md.state_dict_metadata.items()},
            "planner_data": _enc_planner_data(md.planner_data), "storage_data": _enc_records(md)}


# --------------------------------------------------------------------------- decoding
def _dims(v: Any, what: str, fqn: str) -> tuple[int, ...]:
    """A JSON list of at most MAX_NDIM integers in [0, 2**63), as a tuple (messages are built on failure only)."""
    if type(v) is list and len(v) <= fmt.MAX_NDIM:
        for x in v:
            if type(x) is not int:  # bool is an int subclass: refused too
                break
        else:
            if not v or (min(v) >= 0 and max(v) <= fmt.MAX_INT):
                return tuple(v)
    raise InvalidMetadata(f"{what} of {fqn!r} must be a list of integers in [0, 2**63)")


_Record = tuple  # (relative_path, file_offset, length)


def _transform_list(v: Any, fqn: str) -> tuple[str, ...]:
    if not (type(v) is list and 0 < len(v) <= 64 and all(type(t) is str and len(t) <= 256 for t in v)):
        raise InvalidMetadata(f"storage record of {fqn!r} has a malformed 'transform_descriptors'")
    return tuple(v)


def _records(raw: Any, path: str, record_index: dict[Any, int],
             transforms: dict[Any, tuple[str, ...]]) -> dict[tuple[str, Any], _Record]:
    """The storage records by (fqn, chunk offsets or None)."""
    need(type(raw) is list, "'storage_data' must be a list")
    recs: dict[tuple[str, Any], _Record] = {}
    rels: set[str] = set()
    for r in raw:
        if type(r) is not dict or type(r.get("fqn")) is not str:
            raise InvalidMetadata("a storage record needs a string 'fqn'")
        fqn, off, index = r["fqn"], r.get("offset"), r.get("index")
        key = (fqn, None if off is None else _dims(off, "offset", fqn))
        if index is not None:
            if type(index) is not int or index < 0:
                raise InvalidMetadata("a storage record's 'index' must be an integer")
            record_index[key] = index
        rel = r.get("relative_path")
        if type(rel) is not str:
            raise InvalidMetadata(f"storage record of {fqn!r} needs a string 'relative_path'")
        if rel not in rels:
            rels.add(safe_relative_path(rel, path))
        fo, ln = r.get("file_offset"), r.get("length")
        if not (type(fo) is int and type(ln) is int and 0 <= fo <= fmt.MAX_INT and 0 <= ln <= fmt.MAX_INT):
            raise InvalidMetadata(f"storage record of {fqn!r} needs integer 'file_offset' and 'length' in [0, 2**63)")
        recs[key] = (rel, fo, ln)
        if "transform_descriptors" in r:
            transforms[key] = _transform_list(r["transform_descriptors"], fqn)
    return recs


def _tensor_chunks(fqn: str, v: dict[str, Any], size: tuple[int, ...], itemsize: int,
                   recs: dict[tuple[str, Any], _Record], missing: list[str],
                   transforms: dict[Any, tuple[str, ...]]) -> tuple[ChunkInfo, ...]:
    raw = v.get("chunks")
    if type(raw) is not list:
        raise InvalidMetadata(f"chunks of {fqn!r} must be a list")
    chunks = []
    whole = list(size)
    for c in raw:
        if type(c) is not dict:
            raise InvalidMetadata(f"a chunk of {fqn!r} must be an object")
        off, sz = c.get("offsets"), c.get("sizes")
        if sz == whole and type(off) is list and len(off) == len(size) and not any(off):
            off, sz = (0,) * len(size), size  # the whole tensor (the common case): equal to checked values
        else:
            off, sz = _dims(off, "chunk offsets", fqn), _dims(sz, "chunk sizes", fqn)
        if not len(off) == len(sz) == len(size):
            raise InvalidMetadata(f"a chunk of {fqn!r} has the wrong number of dims")
        n = itemsize
        for o, s, g in zip(off, sz, size):
            if o + s > g:
                raise InvalidMetadata(f"a chunk of {fqn!r} lies outside the tensor")
            n *= s
        rec = recs.pop((fqn, off), None)
        if rec is None:
            missing.append(f"{fqn}@{list(off)}")
            continue
        if rec[2] != n and (fqn, off) not in transforms:  # an encoded chunk's stored length is its own
            raise InvalidMetadata(f"storage record of {fqn!r}@{list(off)} is {rec[2]} bytes, its chunk holds {n}")
        chunks.append(ChunkInfo(off, sz, *rec))
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


def decode(doc: Any, path: str) -> MetaIndex:
    """Validate a version-1 body into the index of entries; InvalidMetadata or FormatError on a defect."""
    need(type(doc) is dict, "metadata must be a JSON object")
    sdm = doc.get("state_dict_metadata")
    need(type(sdm) is dict, "'state_dict_metadata' must be an object")
    record_index: dict[Any, int] = {}
    transforms: dict[Any, tuple[str, ...]] = {}
    recs = _records(doc.get("storage_data"), path, record_index, transforms)
    entries: dict[str, EntryInfo] = {}
    grad: set[str] = set()
    missing: list[str] = []
    for fqn, v in sdm.items():
        if type(v) is not dict:
            raise InvalidMetadata(f"state_dict_metadata[{fqn!r}] must be an object")
        kind = v.get("type")
        if kind == "bytes":
            rec = recs.pop((fqn, None), None)
            if rec is None:
                missing.append(fqn)
                continue
            entries[fqn] = EntryInfo(fqn, "object", None, None, (ChunkInfo((), (), *rec),))
            continue
        if kind != "tensor":
            raise InvalidMetadata(f"state_dict_metadata[{fqn!r}] has an unknown type")
        name = v.get("dtype")
        dt = fmt.NAMED.get(name) if type(name) is str else None
        if dt is None:
            fmt.dtype_from_name(name, path=path, entry=fqn)  # raises UnknownDtypeError
        size_raw = v.get("size")
        size = _dims(size_raw, "size", fqn)
        chunks = _whole_chunk(fqn, v, size_raw, size, dt[1], recs)
        if chunks is None:
            chunks = _tensor_chunks(fqn, v, size, dt[1], recs, missing, transforms)
        entries[fqn] = EntryInfo(fqn, "tensor", dt[0], size, chunks)
        if v.get("requires_grad"):
            grad.add(fqn)
    for fqn, off in recs:  # records left over belong to nothing described
        item = sdm.get(fqn)
        if item is None:
            raise InvalidMetadata(f"storage record of {fqn!r} names no item of the state dict")
        if item.get("type") == "bytes":
            raise InvalidMetadata(f"storage record of bytes item {fqn!r} has chunk offsets")
        if off is None:
            raise InvalidMetadata(f"storage record of tensor {fqn!r} has no chunk offsets")
        raise InvalidMetadata(f"storage record of {fqn!r}@{list(off)} matches no chunk")
    if missing:
        raise FormatError("metadata has no storage record for this entry", path=path, entry=missing[0])
    check_entries(entries.values(), path)  # shapes torch can make, exact tiling, no aliasing but tied weights
    save_id, top = top_fields(doc)
    return MetaIndex(entries, save_id, top, grad, record_index, transforms)


def planner_data(raw: Any) -> dict[str, tuple[Any, ...]] | None:
    """DCP's ``planner_data`` of a version-1 index (its ``doc["planner_data"]``)."""
    if raw is None:
        return None
    need(type(raw) is dict, "'planner_data' must be an object")
    for v in raw.values():
        need(type(v) is list and all(type(p) in (str, int) for p in v), "planner_data paths must be lists")
    return {k: tuple(v) for k, v in raw.items()}
