"""DCP's ``Metadata`` of an mmapckpt checkpoint with its per-entry records built on demand.

``to_dcp`` builds six DCP objects an entry (a ``TensorStorageMetadata`` with its
properties, size and chunk list, a ``MetadataIndex`` and a ``_StorageInfo``): about
5 us an entry, most of what ``MmapReader.read_metadata`` costs on a many-entry
checkpoint. Here ``state_dict_metadata`` and ``storage_data`` are read-only mappings over
the validated index (every entry is checked before they are made, so building the records
raises nothing). Names, their number and membership come from the index; the records are
built, all at once as ``to_dcp`` builds them, when the first one is asked for. mmapckpt's
own planners and reader ask the index instead (:meth:`StateDictRecords.entry`,
:meth:`StorageRecords.chunk`, :meth:`StorageRecords.info`), so a ``dcp.load`` with
``FastLoadPlanner`` builds none for the tensors it plans itself.

Both mappings hold the same records as ``to_dcp``'s dicts (``tests/format/test_lazymeta.py``
compares them), compare equal to them, and pickle and copy as plain dicts.
"""

from __future__ import annotations

import threading
from collections.abc import ItemsView, Iterator, KeysView, Mapping, ValuesView
from typing import Any

from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

from .entries import ChunkInfo, EntryInfo, paused_gc
from .metaindex import _V1, MetaIndex, dcp_top, to_dcp

__all__ = ["StateDictRecords", "StorageRecords", "lazy_dcp"]


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


def lazy_dcp(ix: MetaIndex, planner_data: Any = _V1) -> Metadata:
    """DCP's ``Metadata`` for a validated index, its records built on demand (see the module)."""
    records = _Records(ix)
    return Metadata(state_dict_metadata=StateDictRecords(records),  # type: ignore[arg-type]
                    storage_data=StorageRecords(records), **dcp_top(ix, planner_data))
