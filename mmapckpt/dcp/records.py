"""DCP's ``Metadata`` of a validated index (``format/metadata/index.py``), built at once or on demand.

The format wing decodes a ``.metadata`` file into its own index (``MetaIndex`` of
``EntryInfo``/``ChunkInfo``) and never builds a DCP object: this module, in the DCP adapter,
is where DCP's classes are built from it (metadata.py reads and decodes a commit into them).

:func:`to_dcp` builds six DCP objects an entry (a ``TensorStorageMetadata`` with its
properties, size and chunk list, a ``MetadataIndex`` and a ``_StorageInfo``): about
5 us an entry, most of what ``MmapReader.read_metadata`` costs on a many-entry
checkpoint. :func:`lazy_dcp` makes ``state_dict_metadata`` and ``storage_data`` read-only
mappings over the index instead (every entry is checked before they are made, so building
the records raises nothing). Names, their number and membership come from the index; the
records are built, all at once as ``to_dcp`` builds them, when the first one is asked for.
mmapckpt's own planners and reader ask the index instead (:meth:`StateDictRecords.entry`,
:meth:`StorageRecords.chunk`, :meth:`StorageRecords.info`), so a ``dcp.load`` with
``FastLoadPlanner`` builds none for the tensors it plans itself.

Both mappings hold the same records as ``to_dcp``'s dicts (``tests/format/test_records.py``
compares them), compare equal to them, and pickle and copy as plain dicts. The index's
``planner_data`` is each version's own form: the caller expands it (``format/metadata/codec.py``
``decode_built``).
"""

from __future__ import annotations

import threading
from collections.abc import ItemsView, Iterator, KeysView, Mapping, ValuesView
from typing import Any

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

from ..format.entries import ChunkInfo, EntryInfo, paused_gc
from ..format.metadata.index import MetaIndex, need, opt_str
from ..reading.chunks import records_by_file

__all__ = ["StateDictRecords", "StorageRecords", "dcp_record", "lazy_dcp", "to_dcp"]


def _descriptors(ix: MetaIndex, key: tuple[str, tuple[int, ...] | None]) -> list[str] | None:
    t = ix.transforms.get(key)
    return None if t is None else list(t)


def _storage_meta(raw: Any, save_id: str | None) -> StorageMeta | None:
    """DCP's ``StorageMeta``; ``save_id`` the index's (a ``SaveId`` with the cross-step references' save ids)."""
    if raw is None:
        return None
    mods = raw.get("modules", [])
    need(type(mods) is list and all(isinstance(m, str) for m in mods), "'modules' must be strings")
    return StorageMeta(checkpoint_id=opt_str(raw.get("checkpoint_id"), "checkpoint_id"),
                       save_id=save_id, modules=list(mods))


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


def _top(ix: MetaIndex, planner_data: Any) -> dict[str, Any]:
    """The fields of DCP's ``Metadata`` other than the entries' records (planner_data, storage_meta, version)."""
    return {"planner_data": planner_data, "storage_meta": _storage_meta(ix.doc.get("storage_meta"), ix.save_id),
            "version": opt_str(ix.doc.get("version"), "version")}


def to_dcp(ix: MetaIndex, planner_data: Any) -> Metadata:
    """DCP's ``Metadata`` for an index (what ``dcp.load`` plans with), with ``planner_data`` as expanded.

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
    return Metadata(state_dict_metadata=sdm, storage_data=storage, **_top(ix, planner_data))


class _Records:
    """The records of one index, all built at the first request for any (both mappings share them).

    All at once, not entry by entry: a planner that asks for one record (DCP's default
    planners) asks for every one, and then pays a dict lookup per access, not a build.
    """

    __slots__ = ("ix", "_built", "_lock")

    def __init__(self, ix: MetaIndex) -> None:
        self.ix = ix
        self._built: tuple[dict[str, Any], dict[MetadataIndex, _StorageInfo]] | None = None
        self._lock = threading.Lock()

    @property
    def built(self) -> bool:
        return self._built is not None

    def all(self) -> tuple[dict[str, Any], dict[MetadataIndex, _StorageInfo]]:
        """(state_dict_metadata, storage_data) as ``to_dcp`` builds them."""
        built = self._built
        if built is None:
            with self._lock:
                if self._built is None:
                    with paused_gc():
                        md = to_dcp(self.ix, None)
                    self._built = (md.state_dict_metadata, md.storage_data)  # type: ignore[assignment]
                built = self._built
        return built  # type: ignore[return-value]


class StateDictRecords(Mapping[str, Any]):
    """``Metadata.state_dict_metadata`` of an mmapckpt index: names from the index, values built on first access."""

    __slots__ = ("_r",)

    def __init__(self, records: _Records) -> None:
        self._r = records

    def entry(self, name: str) -> EntryInfo | None:
        """The validated index entry behind ``name`` (no DCP object is built), or None."""
        return self._r.ix.entries.get(name)

    @property
    def entries(self) -> Mapping[str, EntryInfo]:
        """The validated index entries by name (no DCP object is built): :meth:`entry` for many names."""
        return self._r.ix.entries

    def __getitem__(self, name: str) -> Any:
        return self._r.all()[0][name]

    def get(self, name: str, default: Any = None) -> Any:  # type: ignore[override]
        return self._r.all()[0].get(name, default)

    def __contains__(self, name: object) -> bool:
        return name in self._r.ix.entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._r.ix.entries)

    def items(self) -> ItemsView[str, Any]:  # type: ignore[override]
        return self._r.all()[0].items()

    def values(self) -> ValuesView[Any]:  # type: ignore[override]
        return self._r.all()[0].values()

    def __len__(self) -> int:
        return len(self._r.ix.entries)

    def keys(self) -> KeysView[str]:
        return self._r.ix.entries.keys()

    def __reduce__(self) -> tuple[Any, ...]:
        return dict, (dict(self.items()),)

    def __repr__(self) -> str:
        return f"StateDictRecords({len(self)} entries)"


class StorageRecords(Mapping[MetadataIndex, _StorageInfo]):
    """``Metadata.storage_data`` of an mmapckpt index: built on first access (:meth:`info` builds one alone)."""

    __slots__ = ("_r",)

    def __init__(self, records: _Records) -> None:
        self._r = records

    def chunk(self, idx: MetadataIndex) -> tuple[EntryInfo, ChunkInfo] | None:
        """The index entry and stored chunk ``idx`` names (no DCP object is built), or None."""
        e = self._r.ix.entries.get(idx.fqn)
        if e is None or (idx.offset is None) != (e.kind == "object"):
            return None
        if idx.offset is None:
            return e, e.chunks[0]
        chunks, hint = e.chunks, idx.index
        if hint is not None and 0 <= hint < len(chunks) and chunks[hint].offsets == idx.offset:
            return e, chunks[hint]
        for c in chunks:
            if c.offsets == idx.offset:
                return e, c
        return None

    def located(self, idx: MetadataIndex) -> tuple[_StorageInfo, tuple[torch.dtype, torch.Size] | None] | None:
        """:meth:`info` and, for a tensor chunk, its (dtype, sizes), from one lookup of the index; None: no record.

        What the reader asks for each item of a plan (dcp/read_paths.py ``read_plan``); where the records
        carry transform descriptors, the built record and no layout (the reader then asks the index again).
        """
        r = self._r
        if r.built or r.ix.transforms:
            found = r.all()[1].get(idx)
            return None if found is None else (found, None)
        c = self.chunk(idx)
        if c is None:
            return None
        e, ch = c
        return (_StorageInfo(ch.file, ch.file_offset, ch.length, None),
                (e.dtype, ch.sizes) if e.kind == "tensor" else None)

    def records_by_file(self) -> dict[str, list[tuple[Any, ...]]]:
        """Per shard file, its entries as the index places them (what ``Shard.agrees`` compares: reading/shard.py)."""
        return records_by_file(self._r.ix.entries)

    def info(self, idx: MetadataIndex) -> _StorageInfo | None:
        """The record ``idx`` names, built alone (not kept), or None: what the reader asks for each item."""
        if self._r.built or self._r.ix.transforms:  # encoded items carry descriptors: the built records
            return self._r.all()[1].get(idx)
        found = self.chunk(idx)
        if found is None:
            return None
        c = found[1]
        return _StorageInfo(c.file, c.file_offset, c.length, transform_descriptors=None)

    def __getitem__(self, idx: MetadataIndex) -> _StorageInfo:
        return self._r.all()[1][idx]

    def get(self, idx: MetadataIndex, default: Any = None) -> Any:  # type: ignore[override]
        return self._r.all()[1].get(idx, default)

    def __contains__(self, idx: object) -> bool:
        return idx in self._r.all()[1]

    def __iter__(self) -> Iterator[MetadataIndex]:
        return iter(self._r.all()[1])

    def items(self) -> ItemsView[MetadataIndex, _StorageInfo]:  # type: ignore[override]
        return self._r.all()[1].items()

    def values(self) -> ValuesView[_StorageInfo]:  # type: ignore[override]
        return self._r.all()[1].values()

    def keys(self) -> KeysView[MetadataIndex]:
        return self._r.all()[1].keys()

    def __len__(self) -> int:
        return len(self._r.all()[1])

    def __reduce__(self) -> tuple[Any, ...]:
        return dict, (dict(self.items()),)

    def __repr__(self) -> str:
        return f"StorageRecords({len(self)} records)"


def lazy_dcp(ix: MetaIndex, planner_data: Any) -> Metadata:
    """As :func:`to_dcp`, its records built on demand (see the module)."""
    records = _Records(ix)
    return Metadata(state_dict_metadata=StateDictRecords(records),  # type: ignore[arg-type]
                    storage_data=StorageRecords(records), **_top(ix, planner_data))
