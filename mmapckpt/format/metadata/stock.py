"""Reading stock DCP metadata (a pickled ``Metadata``) without running code.

The pickle is walked with pickletools first (the C unpickler allocates by numbers in
the file), then unpickled with an unpickler that admits only the DCP metadata
classes, and the objects it built are checked field by field, since a pickle's
BUILD can give any object any attributes. Never a plain ``pickle.load``.

The pickle holds DCP's own classes, and the unpickler admits exactly those (their module and
class names): reading a stock ``.metadata`` imports ``torch.distributed.checkpoint`` (on the
first read, :func:`_dcp`), importing this module does not. Stand-ins of our own for DCP's
classes were not chosen: each torch version pickles them its own way (dataclass state,
``TensorProperties.__setstate__``, the legacy sharded-tensor classes), which DCP's own classes
follow by construction.
"""

from __future__ import annotations

import functools
import io
import os
import pathlib
import pickle
import pickletools
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from ...errors import FormatError, UnsafePickleError
from .. import layout as fmt
from ..dtypes import any_dtype_name
from ..entries import ChunkInfo, EntryInfo, safe_relative_path
from ..stock import raw_record
from ..tiling import check_entries

if TYPE_CHECKING:
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

__all__ = ["decode_stock", "decode_stock_index", "stock_index"]


@functools.cache
def _dcp() -> Any:
    """DCP's metadata classes (a stock ``.metadata`` is a pickle of them), imported on the first stock read."""
    import torch.distributed._shard.sharded_tensor.metadata as legacy
    import torch.distributed.checkpoint.metadata as m
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    return SimpleNamespace(m=m, legacy=legacy, _StorageInfo=_StorageInfo)


def _allowed_globals() -> dict[tuple[str, str], Any]:
    import torch  # loaded already by _dcp(): a stock read imports DCP's classes

    d = _dcp()
    m, legacy = d.m, d.legacy
    allowed: dict[tuple[str, str], Any] = {
        (m.__name__, c.__name__): c
        for c in (m.Metadata, m.MetadataIndex, m.TensorStorageMetadata, m.ChunkStorageMetadata,
                  m.TensorProperties, m.BytesStorageMetadata, m.StorageMeta, m._MEM_FORMAT_ENCODING)
    }
    # Written by older torch versions, which used the sharded-tensor module's TensorProperties;
    # torch still loads them (and its own compatibility tests cover them).
    for c in (legacy.TensorProperties, legacy.MEM_FORMAT_ENCODING):
        allowed[(legacy.__name__, c.__name__)] = c
    allowed[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = d._StorageInfo
    allowed[("torch", "Size")] = torch.Size
    allowed[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
    for cls in (pathlib.PosixPath, pathlib.PurePosixPath, pathlib.WindowsPath, pathlib.PureWindowsPath):
        allowed[("pathlib", cls.__name__)] = cls
    allowed[("collections", "OrderedDict")] = __import__("collections").OrderedDict
    for name in dir(torch):
        if isinstance(getattr(torch, name, None), torch.dtype):
            allowed[("torch", name)] = getattr(torch, name)
    return allowed


class _RestrictedUnpickler(pickle.Unpickler):
    _allowed: dict[tuple[str, str], Any] | None = None

    def find_class(self, module: str, name: str) -> Any:
        if _RestrictedUnpickler._allowed is None:
            _RestrictedUnpickler._allowed = _allowed_globals()
        try:
            return _RestrictedUnpickler._allowed[(module, name)]
        except KeyError:
            raise UnsafePickleError(f"stock DCP metadata refers to {module}.{name}, which is not a DCP metadata class") from None

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafePickleError("stock DCP metadata uses persistent ids; refusing")


_MEMO_OPS = frozenset({"PUT", "BINPUT", "LONG_BINPUT", "GET", "BINGET", "LONG_BINGET"})


def _prescan(data: bytes, path: str) -> None:
    """Walk the opcodes before unpickling: the C unpickler allocates by numbers in the file.

    A memo index of 2**31 makes it grow its memo table to that many slots (gigabytes),
    and a counted bytes/str opcode allocates its claimed length before reading it.
    pickletools checks every counted length against the bytes that are there; memo
    indices larger than the file itself cannot come from a real pickle.
    """
    try:
        for op, arg, _ in pickletools.genops(data):
            if op.name in _MEMO_OPS and isinstance(arg, int) and not 0 <= arg <= len(data):
                raise FormatError(f"stock DCP metadata uses memo index {arg} in a {len(data)}-byte pickle", path=path)
    except FormatError:
        raise
    except Exception as e:  # ValueError for truncated or unknown opcodes
        raise FormatError(f"stock DCP metadata is not a valid pickle: {type(e).__name__}: {e}"[:500], path=path) from None


def decode_stock(data: bytes, path: str) -> Metadata:
    """Checked stock DCP ``Metadata`` from a ``.metadata`` pickle's bytes; every defect raises FormatError."""
    return decode_stock_index(data, path)[0]


def decode_stock_index(data: bytes, path: str) -> tuple[Metadata, dict[str, EntryInfo]]:
    """As :func:`decode_stock`, with the index of entries it was checked through (:func:`stock_index`)."""
    _prescan(data, path)
    try:
        md = _RestrictedUnpickler(io.BytesIO(data)).load()
    except UnsafePickleError as e:
        raise UnsafePickleError(e.message, path=path) from None
    except Exception as e:  # any malformed pickle: truncated, bad opcodes, wrong arguments
        raise FormatError(f"stock DCP metadata could not be unpickled: {type(e).__name__}: {e}", path=path) from None
    try:
        _check_stock(md, path)
    except (AttributeError, TypeError) as e:  # objects built by the pickle with odd fields
        raise FormatError(f"stock DCP metadata has malformed objects: {type(e).__name__}: {e}", path=path) from None
    entries = stock_index(md, path)
    check_entries(_unshared(entries), path)  # as every mmapckpt index is checked (format/tiling.py)
    return md, entries


def _unshared(entries: dict[str, EntryInfo]) -> list[EntryInfo]:
    """The entries, with the byte ranges of safetensors-format tensor records dropped for the overlap check.

    ``FileSystemWriter(serialization_format=SAFETENSORS)`` records every tensor chunk of a shard
    at the one offset where the shard's safetensors data starts, each record exactly its chunk's
    bytes (:func:`~mmapckpt.format.stock.raw_record`), so those records overlap by design. Every
    reader finds such a chunk by name in that safetensors data, whose own header is checked for
    overlaps, never in the record's range: a raw record whose start another tensor record of its
    file shares is such a record, whatever the lengths (two tensors of equal size have equal ones).
    torch.save items never share a start (each writes its own bytes).
    """
    starts: dict[tuple[str, int], int] = {}
    for e in entries.values():
        if e.kind == "tensor":
            for c in e.chunks:
                starts[(c.file, c.file_offset)] = starts.get((c.file, c.file_offset), 0) + 1

    def in_safetensors(e: EntryInfo, c: ChunkInfo) -> bool:
        return starts[(c.file, c.file_offset)] > 1 and raw_record(c.length, e.dtype, c.sizes)  # type: ignore[arg-type]

    if all(n == 1 for n in starts.values()):
        return list(entries.values())
    return [e._replace(chunks=tuple(c._replace(length=0) if in_safetensors(e, c) else c for c in e.chunks))
            if e.kind == "tensor" else e for e in entries.values()]


_MISSING = object()


def _get(obj: Any, name: str, ok: Any, path: str, what: str) -> Any:
    """``obj.name`` (a pickle's BUILD may have dropped or replaced it), checked with ``ok``."""
    v = getattr(obj, name, _MISSING)
    if v is _MISSING or not ok(v):
        raise FormatError(f"stock DCP metadata: {what} has a missing or invalid field {name!r}", path=path)
    return v


def _is_int(v: Any) -> bool:
    return type(v) is int and 0 <= v <= fmt.MAX_INT


def _check_stock(md: Any, path: str) -> None:
    """The unpickled objects have the types and fields DCP's own code expects of them."""
    m, info_cls = _dcp().m, _dcp()._StorageInfo
    if not isinstance(md, m.Metadata):
        raise FormatError("stock DCP metadata does not hold a Metadata object", path=path)
    sdm = _get(md, "state_dict_metadata", lambda v: isinstance(v, dict), path, "Metadata")
    storage = _get(md, "storage_data", lambda v: isinstance(v, dict), path, "Metadata")
    _get(md, "planner_data", lambda v: v is None or isinstance(v, dict), path, "Metadata")
    _get(md, "version", lambda v: v is None or isinstance(v, str), path, "Metadata")
    sm = _get(md, "storage_meta", lambda v: v is None or isinstance(v, m.StorageMeta), path, "Metadata")
    if sm is not None:
        _get(sm, "save_id", lambda v: v is None or isinstance(v, str), path, "StorageMeta")
        _get(sm, "load_id", lambda v: v is None or isinstance(v, str), path, "StorageMeta")
        _get(sm, "modules", lambda v: isinstance(v, list), path, "StorageMeta")
        _get(sm, "checkpoint_id", lambda v: v is None or isinstance(v, (str, os.PathLike)), path, "StorageMeta")
    for idx, info in storage.items():
        if not isinstance(idx, m.MetadataIndex) or not isinstance(info, info_cls):
            raise FormatError("stock DCP metadata has storage records of unexpected types", path=path)
        fqn = _get(idx, "fqn", lambda v: isinstance(v, str), path, "a storage index")
        _get(idx, "offset", lambda v: v is None or _is_dims(v), path, f"storage index of {fqn!r}")
        _get(idx, "index", lambda v: v is None or _is_int(v), path, f"storage index of {fqn!r}")
        rel = _get(info, "relative_path", lambda v: isinstance(v, str), path, f"storage record of {fqn!r}")
        safe_relative_path(rel, path)
        for name in ("offset", "length"):
            _get(info, name, _is_int, path, f"storage record of {fqn!r}")
        _get(info, "transform_descriptors", lambda v: v is None or isinstance(v, (list, tuple)), path,
             f"storage record of {fqn!r}")
    for fqn, item in sdm.items():
        if not isinstance(fqn, str) or not _stock_item_ok(item):
            raise FormatError(f"state_dict_metadata[{fqn!r}] is not a valid DCP item description", path=path)
    _check_records(sdm, storage, path)


def _is_dims(v: Any) -> bool:
    import torch  # loaded already: v was unpickled from DCP's classes

    return isinstance(v, torch.Size) and len(v) <= fmt.MAX_NDIM and all(0 <= x <= fmt.MAX_INT for x in v)


def _tensor_properties() -> tuple[type, ...]:
    """TensorProperties classes of DCP metadata: today's, and the sharded-tensor one older torch wrote."""
    d = _dcp()
    return d.m.TensorProperties, d.legacy.TensorProperties


def _stock_item_ok(item: Any) -> bool:
    import torch  # loaded already: item was unpickled from DCP's classes

    m = _dcp().m
    if isinstance(item, m.BytesStorageMetadata):
        return True
    props = getattr(item, "properties", None)
    chunks = getattr(item, "chunks", None)
    if not (isinstance(item, m.TensorStorageMetadata) and isinstance(props, _tensor_properties())
            and isinstance(getattr(props, "dtype", None), torch.dtype) and _is_dims(getattr(item, "size", None))
            and isinstance(chunks, list)):
        return False
    return all(isinstance(c, m.ChunkStorageMetadata) and _is_dims(getattr(c, "offsets", None))
               and _is_dims(getattr(c, "sizes", None)) and len(c.offsets) == len(c.sizes) == len(item.size)
               and all(o + n <= g for o, n, g in zip(c.offsets, c.sizes, item.size)) for c in chunks)


def _check_records(sdm: dict[str, Any], storage: dict[MetadataIndex, _StorageInfo], path: str) -> None:
    """Every storage record belongs to a described item (and, for a tensor, to one of its chunks)."""
    bytes_item = _dcp().m.BytesStorageMetadata
    for idx in storage:
        md = sdm.get(idx.fqn)
        if md is None:
            raise FormatError(f"invalid stock DCP metadata: storage record of {idx.fqn!r} names no item of the "
                              "state dict", path=path)
        if isinstance(md, bytes_item):
            if idx.offset is not None:
                raise FormatError(f"invalid stock DCP metadata: storage record of bytes item {idx.fqn!r} has "
                                  "chunk offsets", path=path)
            continue
        if idx.offset is None or not any(tuple(c.offsets) == tuple(idx.offset) for c in md.chunks):
            raise FormatError(f"invalid stock DCP metadata: storage record of {idx.fqn!r} matches no chunk",
                              path=path)


def stock_index(md: Metadata, path: str) -> dict[str, EntryInfo]:
    """Index checked stock metadata by name, joining each chunk with its storage record."""
    bytes_item = _dcp().m.BytesStorageMetadata
    records = {(idx.fqn, None if idx.offset is None else tuple(idx.offset)): info
               for idx, info in (md.storage_data or {}).items()}
    out: dict[str, EntryInfo] = {}
    for name, item in md.state_dict_metadata.items():
        if isinstance(item, bytes_item):
            pairs = [((name, None), None)]
        else:
            pairs = [((name, tuple(c.offsets)), c) for c in item.chunks]
        chunks = []
        for key, c in pairs:
            info = records.get(key)
            if info is None:
                label = name if key[1] is None else f"{name}@{list(key[1])}"
                raise FormatError("metadata has no storage record for this entry", path=path, entry=label)
            sizes = () if c is None else tuple(c.sizes)
            chunks.append(ChunkInfo(key[1] or (), sizes, info.relative_path, info.offset, info.length))
        if isinstance(item, bytes_item):
            out[name] = EntryInfo(name, "object", None, None, tuple(chunks))
        else:
            out[name] = EntryInfo(name, "tensor", any_dtype_name(item.properties.dtype), tuple(item.size),
                                  tuple(chunks))
    return out
