"""The body of an mmapckpt ``.metadata`` file, validated once into the index of entries.

The JSON document is checked in one pass straight into ``EntryInfo``/``ChunkInfo``
records (what the lazy loader and ``load_into`` use as they are); DCP's ``Metadata``
objects are built from that index only for ``dcp.load`` (:func:`to_dcp`). Messages
are built only on failure: a valid file of many entries is decoded at the speed of
the JSON parser.
"""

from __future__ import annotations

import math
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

from ..errors import FormatError
from .entries import safe_relative_path
from . import layout as fmt
from .entries import ChunkInfo, EntryInfo
from .tiling import check_entries

__all__ = ["InvalidMetadata", "MetaIndex", "dcp_record", "dcp_top", "index_doc", "to_dcp"]


class InvalidMetadata(Exception):
    """A defect of the document; the caller raises FormatError naming the file."""


def _need(cond: bool, what: str) -> None:
    if not cond:
        raise InvalidMetadata(what)


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


def _opt_str(v: Any, what: str) -> str | None:
    _need(v is None or isinstance(v, str), f"{what} must be a string or null")
    return v


class MetaIndex(NamedTuple):
    """A validated mmapckpt ``.metadata``: the entries, and what DCP's ``Metadata`` also carries."""

    entries: dict[str, EntryInfo]
    save_id: str | None
    doc: dict[str, Any]  # the document's version, planner_data and storage_meta (not its entries)
    requires_grad: set[str]
    record_index: dict[tuple[str, tuple[int, ...] | None], int]  # MetadataIndex.index hints
    #: the stream-transform descriptors of items stored encoded (MmapWriter(_extensions=...)), by key
    transforms: dict[tuple[str, tuple[int, ...] | None], tuple[str, ...]] = {}


_Record = tuple  # (relative_path, file_offset, length)
_V1 = object()  # to_dcp: planner_data from a version-1 document


def _transform_list(v: Any, fqn: str) -> tuple[str, ...]:
    if not (type(v) is list and 0 < len(v) <= 64 and all(type(t) is str and len(t) <= 256 for t in v)):
        raise InvalidMetadata(f"storage record of {fqn!r} has a malformed 'transform_descriptors'")
    return tuple(v)


def _records(raw: Any, path: str, record_index: dict[Any, int],
             transforms: dict[Any, tuple[str, ...]]) -> dict[tuple[str, Any], _Record]:
    """The storage records by (fqn, chunk offsets or None)."""
    _need(type(raw) is list, "'storage_data' must be a list")
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


def index_doc(doc: Any, path: str) -> MetaIndex:
    _need(type(doc) is dict, "metadata must be a JSON object")
    sdm = doc.get("state_dict_metadata")
    _need(type(sdm) is dict, "'state_dict_metadata' must be an object")
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
        dt = fmt.DTYPES.get(name) if type(name) is str else None
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
    sm = doc.get("storage_meta")
    _need(sm is None or type(sm) is dict, "'storage_meta' must be an object")
    save_id = None if sm is None else _opt_str(sm.get("save_id"), "save_id")
    # Only the small top-level fields are kept: the entries' JSON is freed by the caller while
    # the collector is still paused (freeing 100,000 entries' dicts later cost 2.6 us an entry).
    top = {k: doc.get(k) for k in ("version", "planner_data", "storage_meta")}
    return MetaIndex(entries, save_id, top, grad, record_index, transforms)


def _descriptors(ix: MetaIndex, key: tuple[str, tuple[int, ...] | None]) -> list[str] | None:
    t = ix.transforms.get(key)
    return None if t is None else list(t)


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


def dcp_record(ix: MetaIndex, name: str, e: EntryInfo, zeros: dict[int, torch.Size]
               ) -> tuple[Any, list[tuple[MetadataIndex, _StorageInfo]]]:
    """One entry's DCP records: its ``state_dict_metadata`` value and its ``storage_data`` items.

    ``zeros`` holds the all-zero offsets by rank, shared between calls (``torch.Size`` is immutable).
    """
    hints = ix.record_index
    if e.kind == "object":
        c = e.chunks[0]
        return BytesStorageMetadata(), [(MetadataIndex(name, None, hints.get((name, None))), _StorageInfo(
            c.file, c.file_offset, c.length, transform_descriptors=_descriptors(ix, (name, None))))]
    size = torch.Size(e.shape)
    chunks = []
    records = []
    for c in e.chunks:
        off = zeros.get(len(c.offsets)) if not any(c.offsets) else None
        if off is None:
            off = torch.Size(c.offsets)
            if not any(c.offsets):
                zeros[len(c.offsets)] = off
        chunks.append(ChunkStorageMetadata(offsets=off, sizes=size if c.sizes == e.shape else torch.Size(c.sizes)))
        records.append((MetadataIndex(name, off, hints.get((name, c.offsets))), _StorageInfo(
            c.file, c.file_offset, c.length,
            transform_descriptors=_descriptors(ix, (name, c.offsets)) if ix.transforms else None)))
    return TensorStorageMetadata(TensorProperties(dtype=e.dtype, requires_grad=name in ix.requires_grad),
                                 size, chunks), records


def dcp_top(ix: MetaIndex, planner_data: Any = _V1) -> dict[str, Any]:
    """The fields of DCP's ``Metadata`` other than the entries' records (planner_data, storage_meta, version)."""
    pd = _planner_data(ix.doc.get("planner_data")) if planner_data is _V1 else planner_data
    return {"planner_data": pd, "storage_meta": _storage_meta(ix.doc.get("storage_meta")),
            "version": _opt_str(ix.doc.get("version"), "version")}


def to_dcp(ix: MetaIndex, planner_data: Any = _V1) -> Metadata:
    """DCP's ``Metadata`` for an index (what ``dcp.load`` plans with).

    The immutable ``torch.Size`` objects are shared where values are equal (a whole
    chunk's sizes are the tensor's size; all-zero offsets one object per rank), which
    halves the objects built per entry; every mutable record is built per entry.
    """
    sdm: dict[str, Any] = {}
    storage: dict[MetadataIndex, _StorageInfo] = {}
    zeros: dict[int, torch.Size] = {}
    for name, e in ix.entries.items():
        sdm[name], records = dcp_record(ix, name, e, zeros)
        storage.update(records)
    return Metadata(state_dict_metadata=sdm, storage_data=storage, **dcp_top(ix, planner_data))


