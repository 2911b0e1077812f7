"""Which casts a load makes and which it refuses: the one rule of ``load_into``, ``load``, ``load_model`` and
``convert --dtype``.

A cast rounds each stored value to the target dtype's precision: that is what a cast is for (float32 to
bfloat16, int64 ``2**60`` to float32) and it is never refused. A cast is refused (:class:`CastError`
unless the caller passes ``allow_cast=True``) when a value would come out as something other than its
rounding:

* **kind**: floating point or complex into an integer or bool (the fraction is cut off), complex into
  real (the imaginary part is dropped). Decided from the dtypes alone;
* **range**: an integer outside the target integer dtype's range (int64 1000 into int8 would wrap to
  -24; a negative value into an unsigned dtype; anything but 0 and 1 into bool), or a finite value
  whose magnitude rounds past the target floating dtype's largest finite value (float32 ``1e30`` into
  float16 would become inf; into a float8 without inf it would saturate or become NaN). Decided from
  the values: the stored tensor's smallest and largest (finite) values, one reduction over it, only
  for pairs of dtypes where some value could fall outside (:func:`range_can_shrink`). inf and NaN
  stay inf and NaN and are not refused. A load checks the values as it copies them
  (:func:`copy_in_range`): each piece is checked, then written while its bytes are still in the
  CPU's cache, so the stored bytes are read once, not once for the check and again for the copy.
"""

from __future__ import annotations

import math
from typing import Iterator

import torch

from ..errors import CastError

__all__ = ["kind_loss", "range_can_shrink", "out_of_range", "check_cast", "copy_in_range", "CastError"]

#: elements reduced at a time: bounds the temporary memory of a source holding inf or NaN
_PIECE = 1 << 24
#: elements checked then copied at a time by copy_in_range: 1-4 MiB of most dtypes, so that the copy
#: reads the piece the check just read from the CPU's cache, not from memory again
_COPY_PIECE = 1 << 20


def kind_loss(stored: torch.dtype, target: torch.dtype) -> str | None:
    """Why casting ``stored`` to ``target`` changes the kind of every value, or None when it does not."""
    if stored.is_complex and not target.is_complex:
        return "the imaginary parts would be dropped" if target.is_floating_point \
            else "the imaginary parts would be dropped and the fractions cut off"
    if stored.is_floating_point and not (target.is_floating_point or target.is_complex):
        return "the fractions would be cut off"
    return None


def _component(dtype: torch.dtype) -> torch.dtype:
    """The real dtype of each part of a complex dtype (the dtype itself otherwise)."""
    return {torch.complex32: torch.float16, torch.complex64: torch.float32,
            torch.complex128: torch.float64}.get(dtype, dtype)


def _bounds(dtype: torch.dtype) -> tuple[float, float]:
    """The smallest and largest finite value of a real dtype (bool: 0 and 1)."""
    if dtype == torch.bool:
        return 0, 1
    info = torch.finfo(dtype) if dtype.is_floating_point else torch.iinfo(dtype)
    return info.min, info.max


def range_can_shrink(stored: torch.dtype, target: torch.dtype) -> bool:
    """Whether some value of ``stored`` may lie outside what ``target`` holds (so the values must be checked)."""
    if stored == target or stored == torch.bool or kind_loss(stored, target) is not None:
        return False
    s, t = _component(stored), _component(target)
    (slo, shi), (tlo, thi) = _bounds(s), _bounds(t)
    return slo < tlo or shi > thi


def _limit(dtype: torch.dtype) -> float:
    """The magnitude from which a value no longer rounds to ``dtype``'s largest finite value (half an ulp above it)."""
    info = torch.finfo(dtype)
    mantissa = round(-math.log2(info.eps))
    return info.max + 2.0 ** (math.floor(math.log2(info.max)) - mantissa - 1)


def _pieces(t: torch.Tensor, piece: int = _PIECE) -> Iterator[torch.Tensor]:
    """``t`` as views of at most about ``piece`` elements (whole rows), to reduce one at a time."""
    if t.numel() == 0:
        return
    if t.dim() == 0:
        yield t.reshape(1)
        return
    rows = max(1, piece // max(1, t[0].numel()))
    for i in range(0, t.shape[0], rows):
        yield t[i:i + rows]


def _extremes(piece: torch.Tensor) -> tuple[float, float] | None:
    """The smallest and largest finite value of a real ``piece`` (None when it has none), as Python numbers."""
    if piece.dtype in (torch.uint16, torch.uint32):
        piece = piece.to(torch.int64)
    elif piece.dtype == torch.uint64 or piece.dtype.itemsize == 1 and piece.dtype.is_floating_point:
        piece = piece.to(torch.float64 if piece.dtype == torch.uint64 else torch.float32)  # aminmax has no kernel
    lo, hi = torch.aminmax(piece)
    if piece.dtype.is_floating_point and not (torch.isfinite(lo) and torch.isfinite(hi)):
        piece = piece[torch.isfinite(piece)]
        if piece.numel() == 0:
            return None
        lo, hi = torch.aminmax(piece)
    return lo.item(), hi.item()


def _outside(v: float, target: torch.dtype) -> bool:
    if target.is_floating_point:
        cast = torch.tensor(float(v), dtype=torch.float64).to(target).to(torch.float64)  # float8: no isfinite
        return abs(v) > _limit(target) or not math.isfinite(cast.item())
    lo, hi = _bounds(target)
    return not lo <= v <= hi


def _cast_of(v: float, target: torch.dtype) -> object:
    """What casting the one value ``v`` to ``target`` gives (for the message)."""
    if target.is_floating_point:
        return torch.tensor(float(v), dtype=torch.float64).to(target).item()
    try:
        return torch.tensor(int(v), dtype=torch.int64).to(target).item()
    except (RuntimeError, OverflowError):  # past int64: torch has no wider integer to cast from
        return "another value"


def out_of_range(stored: torch.Tensor, target: torch.dtype) -> str | None:
    """What in ``stored`` ``target`` cannot hold (a sentence), or None when every value fits.

    One reduction over ``stored`` (in pieces; a piece holding inf or NaN is filtered, which copies it).
    """
    t = _component(target)
    parts = [stored.real, stored.imag] if stored.is_complex() else [stored]
    for part in parts:
        for piece in _pieces(part):
            ext = _extremes(piece)
            if ext is None:
                continue
            for v in ext:
                if _outside(v, t):
                    lo, hi = _bounds(t)
                    what = "finite values from" if t.is_floating_point else "values from"
                    return f"it holds {v}, outside {target}'s range ({what} {lo} to {hi}): the cast would give " \
                           f"{_cast_of(v, t)}"
    return None


def copy_in_range(stored: torch.Tensor, target: torch.Tensor, *, path: str, entry: str,
                  fix: str = "pass allow_cast=True to cast anyway") -> None:
    """``target.copy_(stored)``, one piece at a time, each piece's values checked (:func:`out_of_range`) before
    it is written: :class:`CastError` naming ``path`` and ``entry`` at the first piece ``target``'s dtype cannot
    hold, with the pieces before it written. One pass over the stored bytes (the check's read brings a piece
    into the CPU's cache, the copy takes it from there), where checking the whole tensor first and copying
    it after reads it twice. Shapes must be equal."""
    for src, dst in zip(_pieces(stored, _COPY_PIECE), _pieces(target, _COPY_PIECE)):
        why = out_of_range(src, target.dtype)
        if why is not None:
            raise CastError(f"the stored {stored.dtype} values cannot be cast to {target.dtype}: {why}; {fix}",
                            path=path, entry=entry)
        dst.copy_(src)  # a 0-dim target's piece is its reshape(1), a view: written too


def check_cast(stored: torch.Tensor | None, stored_dtype: torch.dtype, target: torch.dtype, *,
               allow_cast: bool, path: str, entry: str, fix: str = "pass allow_cast=True to cast anyway") -> None:
    """Raise :class:`CastError` naming ``path`` and ``entry`` when casting to ``target`` is refused (module doc).

    ``stored`` may be None to check the dtypes only (the values are then checked by a later call).
    """
    if allow_cast or stored_dtype == target:
        return
    why = kind_loss(stored_dtype, target)
    if why is None and stored is not None and range_can_shrink(stored_dtype, target):
        why = out_of_range(stored, target)
    if why is not None:
        raise CastError(f"the stored {stored_dtype} values cannot be cast to {target}: {why}; {fix}",
                        path=path, entry=entry)
