"""The checkpoint metadata file (``.metadata``): encoding without pickle, and safe reading.

An mmapckpt ``.metadata`` file is::

    offset 0   magic     8 bytes  b"\\xffMMAPMD\\n"   (0xff is no pickle opcode: the stock
                                                     reader fails at once, running nothing)
    offset 8   major     u16      1
    offset 10  minor     u16      0
    offset 12  body_crc  u32      CRC-32 (zlib) of the body
    offset 16  body_len  u64
    offset 24  body      UTF-8 JSON encoding of torch's DCP ``Metadata`` (see docs/format.md)

Stock DCP checkpoints keep a pickled ``Metadata``; it is read here with an
unpickler that admits only the DCP metadata classes, never a plain ``pickle.load``.
"""

from __future__ import annotations

import io
import json
import os
import pathlib
import pickle
import pickletools
import struct
import zlib
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

from . import format as fmt
from .errors import BadMagicError, FormatError, UnsafePathError, UnsafePickleError, UnsupportedVersionError

__all__ = [
    "METADATA_NAME",
    "META_MAGIC",
    "encode_metadata",
    "decode_metadata",
    "read_metadata_file",
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


def encode_metadata(md: Metadata) -> bytes:
    """Encode DCP ``Metadata`` whose storage_data values are ``_StorageInfo`` records."""
    storage = []
    for idx, info in (md.storage_data or {}).items():
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


def _ints(v: Any, what: str) -> list[int]:
    _need(isinstance(v, list) and len(v) <= fmt.MAX_NDIM and all(type(x) is int and 0 <= x <= fmt.MAX_INT for x in v),
          f"{what} must be a list of integers in [0, 2**63)")
    return v


def _opt_str(v: Any, what: str) -> str | None:
    _need(v is None or isinstance(v, str), f"{what} must be a string or null")
    return v


def _dec_item(fqn: str, v: Any, path: str) -> Any:
    _need(isinstance(v, dict), f"state_dict_metadata[{fqn!r}] must be an object")
    if v.get("type") == "bytes":
        return BytesStorageMetadata()
    _need(v.get("type") == "tensor", f"state_dict_metadata[{fqn!r}] has an unknown type")
    dtype = fmt.dtype_from_name(v.get("dtype"), path=path, entry=fqn)
    size = _ints(v.get("size"), f"size of {fqn!r}")
    chunks_raw = v.get("chunks")
    _need(isinstance(chunks_raw, list), f"chunks of {fqn!r} must be a list")
    chunks = []
    for c in chunks_raw:
        _need(isinstance(c, dict), f"a chunk of {fqn!r} must be an object")
        off, sz = _ints(c.get("offsets"), f"chunk offsets of {fqn!r}"), _ints(c.get("sizes"), f"chunk sizes of {fqn!r}")
        _need(len(off) == len(sz) == len(size), f"a chunk of {fqn!r} has the wrong number of dims")
        _need(all(o + s <= g for o, s, g in zip(off, sz, size)), f"a chunk of {fqn!r} lies outside the tensor")
        chunks.append(ChunkStorageMetadata(offsets=torch.Size(off), sizes=torch.Size(sz)))
    props = TensorProperties(dtype=dtype, requires_grad=bool(v.get("requires_grad", False)))
    return TensorStorageMetadata(properties=props, size=torch.Size(size), chunks=chunks)


def _dec_doc(doc: Any, path: str) -> Metadata:
    _need(isinstance(doc, dict), "metadata must be a JSON object")
    sdm_raw = doc.get("state_dict_metadata")
    _need(isinstance(sdm_raw, dict), "'state_dict_metadata' must be an object")
    sdm = {k: _dec_item(k, v, path) for k, v in sdm_raw.items()}
    pd_raw = doc.get("planner_data")
    planner_data = None
    if pd_raw is not None:
        _need(isinstance(pd_raw, dict), "'planner_data' must be an object")
        for v in pd_raw.values():
            _need(isinstance(v, list) and all(type(p) in (str, int) for p in v), "planner_data paths must be lists")
        planner_data = {k: tuple(v) for k, v in pd_raw.items()}
    storage_raw = doc.get("storage_data")
    _need(isinstance(storage_raw, list), "'storage_data' must be a list")
    storage: dict[MetadataIndex, _StorageInfo] = {}
    for r in storage_raw:
        _need(isinstance(r, dict) and isinstance(r.get("fqn"), str), "a storage record needs a string 'fqn'")
        off = r.get("offset")
        off = None if off is None else _ints(off, f"offset of {r['fqn']!r}")
        index = r.get("index")
        _need(index is None or (type(index) is int and index >= 0), "a storage record's 'index' must be an integer")
        rel = r.get("relative_path")
        _need(isinstance(rel, str), f"storage record of {r['fqn']!r} needs a string 'relative_path'")
        safe_relative_path(rel, path)
        fo, ln = r.get("file_offset"), r.get("length")
        _need(type(fo) is int and 0 <= fo <= fmt.MAX_INT and type(ln) is int and 0 <= ln <= fmt.MAX_INT,
              f"storage record of {r['fqn']!r} needs integer 'file_offset' and 'length' in [0, 2**63)")
        storage[MetadataIndex(r["fqn"], off, index)] = _StorageInfo(rel, fo, ln)
    sm_raw = doc.get("storage_meta")
    sm = None
    if sm_raw is not None:
        _need(isinstance(sm_raw, dict), "'storage_meta' must be an object")
        mods = sm_raw.get("modules", [])
        _need(isinstance(mods, list) and all(isinstance(m, str) for m in mods), "'modules' must be strings")
        sm = StorageMeta(checkpoint_id=_opt_str(sm_raw.get("checkpoint_id"), "checkpoint_id"),
                         save_id=_opt_str(sm_raw.get("save_id"), "save_id"), modules=list(mods))
    _check_records(sdm, storage)
    return Metadata(state_dict_metadata=sdm, planner_data=planner_data, storage_data=storage,
                    storage_meta=sm, version=_opt_str(doc.get("version"), "version"))


def _check_records(sdm: dict[str, Any], storage: dict[MetadataIndex, _StorageInfo], exact_lengths: bool = True) -> None:
    """Every stored item belongs to a described item, and (mmapckpt) a tensor chunk's record has its byte length."""
    for idx, info in storage.items():
        md = sdm.get(idx.fqn)
        _need(md is not None, f"storage record of {idx.fqn!r} names no item of the state dict")
        if isinstance(md, BytesStorageMetadata):
            _need(idx.offset is None, f"storage record of bytes item {idx.fqn!r} has chunk offsets")
            continue
        _need(idx.offset is not None, f"storage record of tensor {idx.fqn!r} has no chunk offsets")
        chunk = next((c for c in md.chunks if tuple(c.offsets) == tuple(idx.offset)), None)
        _need(chunk is not None, f"storage record of {idx.fqn!r}@{list(idx.offset)} matches no chunk")
        if not exact_lengths:  # stock records hold torch.save bytes, not raw data
            continue
        n = fmt.DTYPES[fmt.dtype_name(md.properties.dtype)][1]
        for s in chunk.sizes:
            n *= s
        _need(info.length == n, f"storage record of {idx.fqn!r}@{list(idx.offset)} is {info.length} bytes, "
                                f"its chunk holds {n}")


def decode_metadata(data: bytes, path: str) -> Metadata:
    """Decode an mmapckpt ``.metadata`` file's bytes; every defect raises FormatError."""
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
    try:
        doc = json.loads(body.decode("utf-8"))
        return _dec_doc(doc, path)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        if isinstance(e, FormatError):
            raise
        raise FormatError(f"metadata is not valid JSON: {e}", path=path) from None
    except _Bad as e:
        raise FormatError(f"invalid metadata: {e}", path=path) from None


# --------------------------------------------------------------------------- stock DCP metadata
def _allowed_globals() -> dict[tuple[str, str], Any]:
    import torch.distributed.checkpoint.metadata as m

    allowed: dict[tuple[str, str], Any] = {
        (m.__name__, c.__name__): c
        for c in (m.Metadata, m.MetadataIndex, m.TensorStorageMetadata, m.ChunkStorageMetadata,
                  m.TensorProperties, m.BytesStorageMetadata, m.StorageMeta, m._MEM_FORMAT_ENCODING)
    }
    allowed[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = _StorageInfo
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


def _decode_stock(data: bytes, path: str) -> Metadata:
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
    return md


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
    if not isinstance(md, Metadata):
        raise FormatError("stock DCP metadata does not hold a Metadata object", path=path)
    sdm = _get(md, "state_dict_metadata", lambda v: isinstance(v, dict), path, "Metadata")
    storage = _get(md, "storage_data", lambda v: isinstance(v, dict), path, "Metadata")
    _get(md, "planner_data", lambda v: v is None or isinstance(v, dict), path, "Metadata")
    _get(md, "version", lambda v: v is None or isinstance(v, str), path, "Metadata")
    sm = _get(md, "storage_meta", lambda v: v is None or isinstance(v, StorageMeta), path, "Metadata")
    if sm is not None:
        _get(sm, "save_id", lambda v: v is None or isinstance(v, str), path, "StorageMeta")
        _get(sm, "load_id", lambda v: v is None or isinstance(v, str), path, "StorageMeta")
        _get(sm, "modules", lambda v: isinstance(v, list), path, "StorageMeta")
        _get(sm, "checkpoint_id", lambda v: v is None or isinstance(v, (str, os.PathLike)), path, "StorageMeta")
    for idx, info in storage.items():
        if not isinstance(idx, MetadataIndex) or not isinstance(info, _StorageInfo):
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
    try:
        _check_records(sdm, storage, exact_lengths=False)
    except _Bad as e:
        raise FormatError(f"invalid stock DCP metadata: {e}", path=path) from None


def _is_dims(v: Any) -> bool:
    return isinstance(v, torch.Size) and len(v) <= fmt.MAX_NDIM and all(0 <= x <= fmt.MAX_INT for x in v)


def _stock_item_ok(item: Any) -> bool:
    if isinstance(item, BytesStorageMetadata):
        return True
    props = getattr(item, "properties", None)
    chunks = getattr(item, "chunks", None)
    if not (isinstance(item, TensorStorageMetadata) and isinstance(props, TensorProperties)
            and isinstance(getattr(props, "dtype", None), torch.dtype) and _is_dims(getattr(item, "size", None))
            and isinstance(chunks, list)):
        return False
    return all(isinstance(c, ChunkStorageMetadata) and _is_dims(getattr(c, "offsets", None))
               and _is_dims(getattr(c, "sizes", None)) and len(c.offsets) == len(c.sizes) == len(item.size)
               and all(o + n <= g for o, n, g in zip(c.offsets, c.sizes, item.size)) for c in chunks)


def metadata_kind(head: bytes) -> str | None:
    """Which kind of checkpoint a metadata file's first bytes announce, if any."""
    if head.startswith(META_MAGIC):
        return KIND_MMAPCKPT
    if head[:1] == b"\x80":  # pickle protocol 2+
        return KIND_STOCK
    return None


def read_metadata_file(path: str | os.PathLike[str]) -> tuple[str, Metadata]:
    """Read a ``.metadata`` file of either kind; return (kind, Metadata)."""
    p = os.fspath(path)
    with open(p, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size > MAX_METADATA_SIZE:
            raise FormatError(f"metadata file of {size} bytes exceeds the limit of {MAX_METADATA_SIZE}", path=p)
        data = f.read(size)  # not read(MAX_METADATA_SIZE + 1): that allocates the full 1 GiB up front
    kind = metadata_kind(data[:8])
    if kind == KIND_MMAPCKPT:
        return kind, decode_metadata(data, p)
    if kind == KIND_STOCK:
        return kind, _decode_stock(data, p)
    raise BadMagicError("neither mmapckpt nor stock DCP metadata (unknown leading bytes)", path=p)


def safe_relative_path(rel: str, where: str) -> str:
    """Refuse storage paths that could leave the checkpoint directory."""
    bad = (not rel or "\x00" in rel or os.path.isabs(rel) or rel.startswith(("/", "\\"))
           or any(part in ("..", "") for part in rel.replace("\\", "/").split("/")))
    if bad:
        raise UnsafePathError(f"storage path {rel!r} leaves the checkpoint directory", path=where)
    return rel
