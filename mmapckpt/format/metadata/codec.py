"""The ``.metadata`` file's codec: encoding by version, decoding by kind and version.

Encoding writes version 2 (the entry table, v2.py) or, asked for, version 1 (v1.py)
inside the framing (framing.py). Decoding reads the framing, then hands the body to its
version's one decoder (v1.decode, v2.decode), which validates it once into the index of
entries (index.py) that the lazy loader uses as it is; DCP's ``Metadata`` objects are
built from that index only for ``dcp.load``, by the DCP adapter (``dcp/records.py``, through
:func:`decode_built`): nothing here imports ``torch.distributed``. Stock DCP checkpoints keep a
pickled ``Metadata``, read by stock.py without running code (its unpickler needs DCP's
classes, imported when a stock file is read). Every defect raises
FormatError (or a subclass) naming the file, and the entry where there is one.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Callable

from ...errors import FormatError
from ..entries import EntryInfo, paused_gc
from . import v2
from .framing import (
    KIND_MMAPCKPT,
    META_MAJOR,
    META_MINOR,
    META_MINOR_USER,
    META_MINOR_REFS,
    USER_METADATA_KEY,
    body_of,
    check_user_metadata,
    frame,
    major_of,
    parse_body,
)
from .index import InvalidMetadata, MetaIndex

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

    from .written import WrittenMetadata

__all__ = ["encode_metadata", "decode_index", "decode_built", "decode_index_file"]


def encode_metadata(md: Metadata | WrittenMetadata, user_metadata: Mapping[str, str] | None = None, *, major: int = META_MAJOR,
                    references: Mapping[str, str] | None = None) -> bytes:
    """Encode DCP ``Metadata`` whose storage_data values are ``_StorageInfo`` records, or its shape in the
    format's own types (written.py ``WrittenMetadata``, what ``mmapckpt.save`` builds without DCP).

    ``user_metadata`` ({str: str}, as safetensors' ``__metadata__``) is stored as the body's
    ``user_metadata`` key. ``major``: 2 (the entry table, v2.py) or 1 (one JSON object per
    item and record, what mmapckpt wrote before; a 1.x file with user metadata is minor 1).
    ``references``: ``{"../step-M/FILE": its save id}`` of the cross-step references among the storage data
    (docs/format.md 3.4; a save with ``MmapWriter(reuse=...)``), kept as ``storage_meta.references``.
    """
    user = check_user_metadata(user_metadata)
    sm = md.storage_meta
    doc: dict[str, Any] = {"version": md.version}
    if major == 1:
        from . import v1

        doc.update(v1.encode(md))
    elif major == META_MAJOR:
        doc.update(v2.encode(md))
    else:
        raise ValueError(f"cannot write metadata version {major}")
    doc["storage_meta"] = None if sm is None else {
        "checkpoint_id": None if sm.checkpoint_id is None else os.fspath(sm.checkpoint_id),
        "save_id": None if sm.save_id is None else str(sm.save_id),
        "modules": list(sm.modules),
    }
    refs = dict(references or {})
    if refs:  # cross-step references (docs/format.md 3.4): only version 2 reads them
        if major != META_MAJOR:
            raise ValueError("cross-step references need metadata version 2")
        if sm is None:
            raise ValueError("cross-step references need the storage_meta that holds them")
        doc["storage_meta"]["references"] = dict(sorted(refs.items()))
    if user is not None:
        doc[USER_METADATA_KEY] = user
    body = json.dumps(doc, separators=(",", ":"), ensure_ascii=True).encode("ascii")
    minor = META_MINOR_USER if user is not None and major == 1 else META_MINOR_REFS if refs else META_MINOR
    return frame(major, minor, body)


def _v1() -> Any:
    """The version-1 codec, imported for files of that version only (files written before version 2)."""
    from . import v1

    return v1


def _decoding(data: bytes, path: str, build: Callable[[MetaIndex, int], Any], *, entries_only: bool = False) -> Any:
    """``build(index, major)`` of a file's bytes, every defect a FormatError naming ``path``."""
    body = body_of(data, path)
    major = major_of(data)
    try:
        with paused_gc():
            doc, ints_only = parse_body(body)
            ix = _v1().decode(doc, path) if major == 1 else \
                v2.decode(doc, path, ints_only=ints_only, entries_only=entries_only)
            del doc  # freed before the collector resumes, so that it never walks the document
            return build(ix, major)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        if isinstance(e, FormatError):
            raise
        raise FormatError(f"metadata is not valid JSON: {e}", path=path) from None
    except InvalidMetadata as e:
        raise FormatError(f"invalid metadata: {e}", path=path) from None


def _planner_data(ix: MetaIndex, major: int) -> Any:
    """DCP's ``planner_data`` of an index, from the form its version stores."""
    raw = ix.doc.get("planner_data")
    return _v1().planner_data(raw) if major == 1 else v2.planner_paths(raw, ix.entries)


def decode_index(data: bytes, path: str) -> MetaIndex:
    """Decode an mmapckpt ``.metadata`` file's bytes into its index; every defect raises FormatError."""
    return _decoding(data, path, lambda ix, major: ix)


def decode_built(data: bytes, path: str, build: Callable[[MetaIndex, Any], Any]) -> Any:
    """``build(index, planner_data)`` of an mmapckpt ``.metadata`` file's bytes, with DCP's ``planner_data``
    expanded from the form its version stores; ``build`` runs while the collector is paused (it may make
    many objects) and its defects raise FormatError naming ``path``. The DCP adapter builds DCP's
    ``Metadata`` this way (``dcp/metadata.py``); the format wing builds no DCP object itself.
    """
    return _decoding(data, path, lambda ix, major: build(ix, _planner_data(ix, major)))


def decode_index_file(kind: str, data: bytes, path: str) -> tuple[Mapping[str, EntryInfo], str | None]:
    """A ``.metadata`` file's bytes of either kind as (entries by name, save id).

    Every entry is checked before this returns. For a version-2 table of the common shape the
    entries are a ``v2_columns.TableEntries``: names, ``len`` and ``in`` come from the table's
    names, and the ``EntryInfo`` records are built all at once on first access.
    """
    if kind == KIND_MMAPCKPT:
        return _decoding(data, path, lambda ix, major: (ix.entries, ix.save_id), entries_only=True)
    from .stock import decode_stock_index  # pickle's tables: imported for a stock checkpoint only

    md, entries = decode_stock_index(data, path)  # the index the check was made through, not built again
    return entries, getattr(md.storage_meta, "save_id", None)
