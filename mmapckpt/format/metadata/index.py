"""What every version's decoder returns: the validated index of a ``.metadata`` body.

The JSON document is checked in one pass straight into ``EntryInfo``/``ChunkInfo``
records (what the lazy loader and ``load_into`` use as they are); DCP's ``Metadata``
objects are built from this index only for ``dcp.load`` (records.py). Messages are
built only on failure: a valid file of many entries is decoded at the speed of the
JSON parser.
"""

from __future__ import annotations

from typing import Any

from ...records import Record
from ..entries import EntryInfo, SaveId

__all__ = ["InvalidMetadata", "MetaIndex", "need", "opt_str", "top_fields"]


class InvalidMetadata(Exception):
    """A defect of the document; the caller raises FormatError naming the file."""


def need(cond: bool, what: str) -> None:
    """Raise :class:`InvalidMetadata` saying ``what`` unless ``cond``."""
    if not cond:
        raise InvalidMetadata(what)


def opt_str(v: Any, what: str) -> str | None:
    """``v``, a string or None (``what`` names it in the message)."""
    need(v is None or isinstance(v, str), f"{what} must be a string or null")
    return v


def top_fields(doc: dict[str, Any]) -> tuple[str | None, dict[str, Any]]:
    """(save id, the small top-level fields an index keeps) of a body of either version.

    Only these are kept: the entries' JSON is freed by the caller while the collector is
    still paused (freeing 100,000 entries' dicts later cost 2.6 us an entry).
    """
    sm = doc.get("storage_meta")
    need(sm is None or type(sm) is dict, "'storage_meta' must be an object")
    save_id = None if sm is None else opt_str(sm.get("save_id"), "save_id")
    refs = None if sm is None else sm.get("references")
    if refs is not None:
        save_id = SaveId(save_id or "", references_of(refs))
    return save_id, {k: doc.get(k) for k in ("version", "planner_data", "storage_meta")}


def references_of(raw: Any) -> dict[str, str]:
    """``storage_meta.references`` checked: ``{"../step-M/name": the save id that file carries}`` (the names
    are judged where the table's files are, by ``safe_relative_path``: only a listed name of the reference
    form passes, any other is an UnsafePathError)."""
    need(type(raw) is dict and all(type(v) is str and 0 < len(v) <= 256 for v in raw.values()),
         "'references' must map names ../step-M/FILE to save ids")
    return raw


class MetaIndex(Record):
    """A validated mmapckpt ``.metadata``: the entries, and what DCP's ``Metadata`` also carries."""

    __slots__ = ()

    entries: dict[str, EntryInfo]
    save_id: str | None
    doc: dict[str, Any]  # the document's version, planner_data (as its version stores it) and storage_meta
    requires_grad: set[str]
    record_index: dict[tuple[str, tuple[int, ...] | None], int]  # MetadataIndex.index hints
    #: the stream-transform descriptors of items stored encoded (MmapWriter(_extensions=...)), by key
    transforms: dict[tuple[str, tuple[int, ...] | None], tuple[str, ...]]

    def __new__(cls, entries: dict[str, EntryInfo], save_id: str | None, doc: dict[str, Any],
                requires_grad: set[str], record_index: dict[tuple[str, tuple[int, ...] | None], int],
                transforms: dict[tuple[str, tuple[int, ...] | None], tuple[str, ...]] = {}) -> MetaIndex:
        return tuple.__new__(cls, (entries, save_id, doc, requires_grad, record_index, transforms))
