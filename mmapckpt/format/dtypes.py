"""The dtype table of the mmapckpt format: the names a shard header and the metadata use.

Part of the format (docs/format.md, section 2.4); layout.py re-exports it.
"""

from __future__ import annotations

import torch

from ..errors import UnknownDtypeError

__all__ = ["DTYPES", "dtype_name", "dtype_from_name"]

# The dtype table, written out by hand so that the names persisted on disk never
# depend on how a torch version spells its dtypes: name -> (attribute of torch, itemsize).
_DTYPE_TABLE: tuple[tuple[str, str, int], ...] = (
    ("float64", "float64", 8),
    ("float32", "float32", 4),
    ("float16", "float16", 2),
    ("bfloat16", "bfloat16", 2),
    ("float8_e4m3fn", "float8_e4m3fn", 1),
    ("float8_e4m3fnuz", "float8_e4m3fnuz", 1),
    ("float8_e5m2", "float8_e5m2", 1),
    ("float8_e5m2fnuz", "float8_e5m2fnuz", 1),
    ("float8_e8m0fnu", "float8_e8m0fnu", 1),
    ("complex32", "complex32", 4),
    ("complex64", "complex64", 8),
    ("complex128", "complex128", 16),
    ("int8", "int8", 1),
    ("int16", "int16", 2),
    ("int32", "int32", 4),
    ("int64", "int64", 8),
    ("uint8", "uint8", 1),
    ("uint16", "uint16", 2),
    ("uint32", "uint32", 4),
    ("uint64", "uint64", 8),
    ("bool", "bool", 1),
)

#: name -> (torch.dtype, itemsize), for the dtypes the installed torch has.
DTYPES: dict[str, tuple[torch.dtype, int]] = {
    name: (getattr(torch, attr), size)
    for name, attr, size in _DTYPE_TABLE
    if isinstance(getattr(torch, attr, None), torch.dtype)
}
_NAMES: dict[torch.dtype, str] = {dt: name for name, (dt, _) in DTYPES.items()}



def dtype_name(dtype: torch.dtype) -> str:
    """The on-disk name of ``dtype``; raises ValueError for dtypes the format cannot hold."""
    try:
        return _NAMES[dtype]
    except KeyError:
        raise ValueError(f"mmapckpt format v1 cannot store dtype {dtype}") from None


def dtype_from_name(name: object, *, path: str | None = None, entry: str | None = None) -> torch.dtype:
    if not isinstance(name, str) or name not in DTYPES:
        raise UnknownDtypeError(f"unknown dtype {name!r}", path=path, entry=entry)
    return DTYPES[name][0]
