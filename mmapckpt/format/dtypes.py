"""The dtype table of the mmapckpt format: the names a shard header and the metadata use.

Part of the format (docs/format.md, section 2.4); layout.py re-exports it.
"""

from __future__ import annotations

from typing import Any

from ..errors import UnknownDtypeError

__all__ = ["DTYPES", "NAMED", "ITEMSIZES", "dtype_name", "any_dtype_name", "dtype_from_name", "check_dtype_name",
           "torch_dtype"]

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

#: name -> (name, itemsize), for every dtype of the table: what the decoders put in the index (no torch needed).
NAMED: dict[str, tuple[str, int]] = {name: (name, size) for name, _, size in _DTYPE_TABLE}
#: name -> itemsize.
ITEMSIZES: dict[str, int] = {name: size for name, _, size in _DTYPE_TABLE}

DTYPES: dict[str, tuple[Any, int]]  # made on first use: see __getattr__
_TORCH: dict[str, Any] = {}  # name -> torch.dtype, filled on first use (importing torch then)
_NAMES: dict[Any, str] = {}


def _torch_table() -> dict[str, tuple[Any, int]]:
    import torch

    table = {name: (getattr(torch, attr), size) for name, attr, size in _DTYPE_TABLE
             if isinstance(getattr(torch, attr, None), torch.dtype)}
    _NAMES.update({dt: name for name, (dt, _) in table.items()})
    _TORCH.update({name: dt for name, (dt, _) in table.items()})
    return table


def __getattr__(name: str) -> Any:
    """``DTYPES`` (name -> (torch.dtype, itemsize), for the dtypes the installed torch has), made on first use: the
    format's names and sizes need no torch (inspect imports none)."""
    if name == "DTYPES":
        table = _torch_table()
        globals()["DTYPES"] = table
        return table
    raise AttributeError(name)


def dtype_name(dtype: Any) -> str:
    """The on-disk name of ``dtype``; raises ValueError for dtypes the format cannot hold."""
    if not _NAMES:
        _torch_table()
    try:
        return _NAMES[dtype]
    except KeyError:
        raise ValueError(f"mmapckpt format v1 cannot store dtype {dtype}") from None


def any_dtype_name(dtype: Any) -> str:
    """The name of any torch dtype: the format's name, else torch's (``"quint8"``), which :func:`torch_dtype` takes
    back (a torch.save file may hold dtypes the format has no name for)."""
    try:
        return dtype_name(dtype)
    except ValueError:
        return str(dtype).removeprefix("torch.")


def torch_dtype(name: str) -> Any:
    """The torch dtype called ``name`` (:func:`any_dtype_name`'s inverse); imports torch on first use."""
    dt = _TORCH.get(name)
    if dt is None:
        if not _NAMES:
            _torch_table()
        dt = _TORCH.get(name)
        if dt is None:
            import torch

            dt = getattr(torch, name, None)
            if not isinstance(dt, torch.dtype):
                raise UnknownDtypeError(f"unknown dtype {name!r} (not in this torch)")
            _TORCH[name] = dt
    return dt


def check_dtype_name(name: object, *, path: str | None = None, entry: str | None = None) -> str:
    """``name`` if it is a dtype of the format's table, else UnknownDtypeError (no torch needed)."""
    if not isinstance(name, str) or name not in ITEMSIZES:
        raise UnknownDtypeError(f"unknown dtype {name!r}", path=path, entry=entry)
    return name


def dtype_from_name(name: object, *, path: str | None = None, entry: str | None = None) -> Any:
    """The torch dtype of the format's name ``name`` (UnknownDtypeError where unknown, or not in this torch)."""
    if not isinstance(name, str) or name not in ITEMSIZES:
        raise UnknownDtypeError(f"unknown dtype {name!r}", path=path, entry=entry)
    table = __getattr__("DTYPES") if "DTYPES" not in globals() else globals()["DTYPES"]
    if name not in table:
        raise UnknownDtypeError(f"unknown dtype {name!r}", path=path, entry=entry)
    return table[name][0]
