"""The checkpoint metadata file (``.metadata``): encoding without pickle, and safe reading.

An mmapckpt ``.metadata`` file is::

    offset 0   magic     8 bytes  b"\\xffMMAPMD\\n"   (0xff is no pickle opcode: the stock
                                                     reader fails at once, running nothing)
    offset 8   major     u16      1
    offset 10  minor     u16      0
    offset 12  body_crc  u32      CRC-32 (zlib) of the body
    offset 16  body_len  u64
    offset 24  body      UTF-8 JSON encoding of torch's DCP ``Metadata`` (see docs/format.md), with
                         the optional ``user_metadata`` ({str: str}, minor version 1)

Decoding validates the JSON once, into the index of entries (``entries.EntryInfo``, see metaindex.py)
that the lazy loader uses as it is; DCP's ``Metadata`` objects are built from that
index only for ``dcp.load``. Stock DCP checkpoints keep a pickled ``Metadata``,
read by stockmeta.py without running code.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from collections.abc import Mapping
from typing import Any

from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex

from ..errors import (
    BadMagicError,
    FormatError,
    UnsupportedVersionError,
)
from . import layout as fmt
from .entries import EntryInfo, paused_gc
from .lazymeta import lazy_dcp
from .metaindex import InvalidMetadata, MetaIndex, index_doc, to_dcp
from .metatable import encode_planner_data, encode_table, index_table, planner_paths
from .stockmeta import decode_stock, decode_stock_index

__all__ = [
    "METADATA_NAME",
    "META_MAGIC",
    "encode_metadata",
    "check_user_metadata",
    "decode_user_metadata",
    "MetaIndex",
    "decode_index",
    "decode_metadata",
    "decode_metadata_lazy",
    "decode_metadata_file",
    "decode_index_file",
    "metadata_kind",
    "MAX_METADATA_SIZE",
    "KIND_MMAPCKPT",
    "KIND_STOCK",
]

METADATA_NAME = ".metadata"
META_MAGIC = b"\xffMMAPMD\n"
#: Version 2 stores the entries as a table (metatable.py); version 1 files are read as before.
META_MAJOR = 2
META_MINOR = 0
#: The minor version of a metadata file that carries ``user_metadata`` (an optional key: 1.0 readers ignore it).
META_MINOR_USER = 1
USER_METADATA_KEY = "user_metadata"
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


def check_user_metadata(metadata: Any) -> dict[str, str] | None:
    """``metadata`` as a plain ``{str: str}`` dict (None stays None); anything else raises TypeError.

    The same rule as ``safetensors.torch.save_file(metadata=...)``: only strings, so that the
    values round-trip through a safetensors header and never need pickle.
    """
    if metadata is None:
        return None
    if not isinstance(metadata, Mapping):
        raise TypeError(f"metadata must be a dict of str to str, got {type(metadata).__name__}")
    for k, v in metadata.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise TypeError(f"metadata must be a dict of str to str; {k!r}: {v!r} is a "
                            f"{type(k).__name__}: {type(v).__name__} (convert values with str() or json.dumps)")
    return dict(metadata)


def encode_metadata(md: Metadata, user_metadata: Mapping[str, str] | None = None, *, major: int = META_MAJOR) -> bytes:
    """Encode DCP ``Metadata`` whose storage_data values are ``_StorageInfo`` records.

    ``user_metadata`` ({str: str}, as safetensors' ``__metadata__``) is stored as the body's
    ``user_metadata`` key. ``major``: 2 (the entry table, metatable.py) or 1 (one JSON object per
    item and record, what mmapckpt wrote before; a 1.x file with user metadata is minor 1).
    """
    user = check_user_metadata(user_metadata)
    sm = md.storage_meta
    doc: dict[str, Any] = {"version": md.version}
    if major == 1:
        doc["state_dict_metadata"] = {k: _enc_item(v) for k, v in md.state_dict_metadata.items()}
        doc["planner_data"] = _enc_planner_data(md.planner_data)
        doc["storage_data"] = _v1_records(md)
    elif major == META_MAJOR:
        doc["planner_data"] = encode_planner_data(md)
        doc["table"] = encode_table(md)
    else:
        raise ValueError(f"cannot write metadata version {major}")
    doc["storage_meta"] = None if sm is None else {
        "checkpoint_id": None if sm.checkpoint_id is None else os.fspath(sm.checkpoint_id),
        "save_id": sm.save_id,
        "modules": list(sm.modules),
    }
    if user is not None:
        doc[USER_METADATA_KEY] = user
    body = json.dumps(doc, separators=(",", ":"), ensure_ascii=True).encode("ascii")
    minor = META_MINOR_USER if user is not None and major == 1 else META_MINOR
    return _META_PRE.pack(META_MAGIC, major, minor, zlib.crc32(body), len(body)) + body


def _v1_records(md: Metadata) -> list[dict[str, Any]]:
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


def _major(data: bytes) -> int:
    return _META_PRE.unpack_from(data)[1]


def _body(data: bytes, path: str) -> bytes:
    if len(data) < _META_PRE.size or data[:8] != META_MAGIC:
        raise BadMagicError("not an mmapckpt metadata file", path=path)
    _, major, _minor, crc, blen = _META_PRE.unpack_from(data)
    if major not in (1, META_MAJOR):
        raise UnsupportedVersionError(f"metadata version {major}; this mmapckpt reads versions 1.x and "
                                      f"{META_MAJOR}.x", path=path)
    body = data[_META_PRE.size:]
    if len(body) != blen:
        raise FormatError(f"metadata body is {len(body)} bytes, its preamble says {blen}", path=path)
    if zlib.crc32(body) != crc:
        raise FormatError("metadata checksum mismatch: the file is damaged", path=path)
    return body


def _json_ints_only(text: str, body: bytes) -> tuple[Any, bool]:
    """The document, and whether all its numbers are integers and it holds no ``true``/``false``.

    The hooks run only for floats, NaN and infinities, so the answer costs nothing an entry
    beyond two scans of the text (a ``true`` inside a string also says False: only slower).
    """
    other: list[str] = []

    def note(s: str) -> float:
        other.append(s)
        return float(s)

    doc = json.loads(text, parse_float=note, parse_constant=note)
    return doc, not other and b"true" not in body and b"false" not in body


def _decoding(data: bytes, path: str, build: Any, *, entries_only: bool = False) -> Any:
    body = _body(data, path)
    v1 = _major(data) == 1
    try:
        with paused_gc():
            doc, ints_only = _json_ints_only(body.decode("utf-8"), body)
            out = build(index_doc(doc, path) if v1 else
                        index_table(doc, path, ints_only=ints_only, entries_only=entries_only))
            del doc  # freed before the collector resumes, so that it never walks the document
        return out
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        if isinstance(e, FormatError):
            raise
        raise FormatError(f"metadata is not valid JSON: {e}", path=path) from None
    except InvalidMetadata as e:
        raise FormatError(f"invalid metadata: {e}", path=path) from None


def decode_index(data: bytes, path: str) -> MetaIndex:
    """Decode an mmapckpt ``.metadata`` file's bytes into its index; every defect raises FormatError."""
    return _decoding(data, path, lambda ix: ix)


def decode_metadata(data: bytes, path: str) -> Metadata:
    """Decode an mmapckpt ``.metadata`` file's bytes into DCP ``Metadata``; every defect raises FormatError."""
    return _decoding(data, path, _to_dcp)


def decode_metadata_lazy(data: bytes, path: str) -> Metadata:
    """As :func:`decode_metadata`, with the entries' records built on demand (format/lazymeta.py)."""
    return _decoding(data, path, lambda ix: _to_dcp(ix, lazy=True))


def _to_dcp(ix: MetaIndex, *, lazy: bool = False) -> Metadata:
    """DCP ``Metadata`` of an index of either version (version 2 keeps planner_data compact)."""
    if "table" in ix.doc:
        pd = planner_paths(ix.doc.get("planner_data"), ix.entries)
        return lazy_dcp(ix, pd) if lazy else to_dcp(ix, pd)
    return lazy_dcp(ix) if lazy else to_dcp(ix)


def metadata_kind(head: bytes) -> str | None:
    """Which kind of checkpoint a metadata file's first bytes announce, if any."""
    if head.startswith(META_MAGIC):
        return KIND_MMAPCKPT
    if head[:1] == b"\x80":  # pickle protocol 2+
        return KIND_STOCK
    return None


def decode_metadata_file(kind: str, data: bytes, path: str, *, lazy: bool = False) -> Metadata:
    """A ``.metadata`` file's bytes of either kind (``metadata_kind``) as DCP Metadata.

    ``lazy``: an mmapckpt file's ``state_dict_metadata`` and ``storage_data`` are read-only
    mappings whose records are built on first access (format/lazymeta.py); every entry is
    checked before this returns either way.
    """
    if kind != KIND_MMAPCKPT:
        return decode_stock(data, path)
    return decode_metadata_lazy(data, path) if lazy else decode_metadata(data, path)


def decode_index_file(kind: str, data: bytes, path: str) -> tuple[Mapping[str, EntryInfo], str | None]:
    """A ``.metadata`` file's bytes of either kind as (entries by name, save id).

    Every entry is checked before this returns. For a version-2 table of the common shape the
    entries are a ``metabulk.TableEntries``: names, ``len`` and ``in`` come from the table's
    names, and the ``EntryInfo`` records are built all at once on first access.
    """
    if kind == KIND_MMAPCKPT:
        return _decoding(data, path, lambda ix: (ix.entries, ix.save_id), entries_only=True)
    md, entries = decode_stock_index(data, path)  # the index the check was made through, not built again
    return entries, getattr(md.storage_meta, "save_id", None)


def decode_user_metadata(kind: str, data: bytes, p: str) -> dict[str, str] | None:
    """The user metadata ({str: str}) a ``.metadata`` file's bytes carry, or None when it has none.

    Stock DCP metadata (a pickle) has no such field: None. A damaged file, or a
    ``user_metadata`` that is not an object of strings, raises FormatError naming the file.
    """
    if kind != KIND_MMAPCKPT:
        return None
    body = _body(data, p)
    try:
        doc = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise FormatError(f"metadata is not valid JSON: {e}", path=p) from None
    if type(doc) is not dict:
        raise FormatError("invalid metadata: metadata must be a JSON object", path=p)
    user = doc.get(USER_METADATA_KEY)
    if user is None:
        return None
    if type(user) is not dict or not all(type(v) is str for v in user.values()):
        raise FormatError(f"invalid metadata: {USER_METADATA_KEY!r} must be an object of strings", path=p)
    return user
