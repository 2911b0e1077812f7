"""Regions of a tensor stored as chunks: basic indexing turned into a selection, and the selection copied.

``get_slice(name)[index]`` takes ints (negative too), slices with positive steps and one
Ellipsis over the global shape; each chunk contributes only the part the selection
touches (``ChunkBackend.region``), so only those pages of the file are read, or, on a
medium without mappings, only those bytes (:func:`read_region`).
"""

from __future__ import annotations

import operator
from typing import Any

import torch

from ..format.entries import EntryInfo
from ..storage.base import StoredFile
from .backend import ChunkBackend
from .fetches import FetchReads, placeholder

__all__ = ["copy_selection", "normalize_index", "read_region", "read_selection", "read_tensor"]


def _ceil_div(a: int, b: int) -> int:
    return -((-a) // b)


def normalize_index(index: Any, shape: tuple[int, ...]) -> tuple[list[tuple[int, int, int]], list[int]]:
    """Basic indexing -> per-dimension (start, step, count) and the shape of the result."""
    items = list(index) if isinstance(index, tuple) else [index]
    if sum(i is Ellipsis for i in items) > 1:
        raise IndexError("an index can only have a single ellipsis ('...')")
    if Ellipsis in items:
        at = items.index(Ellipsis)
        items[at:at + 1] = [slice(None)] * (len(shape) - (len(items) - 1))
    if len(items) > len(shape):
        raise IndexError(f"too many indices for tensor of dimension {len(shape)}")
    items += [slice(None)] * (len(shape) - len(items))
    sel, out_shape = [], []
    for dim, (it, size) in enumerate(zip(items, shape)):
        if isinstance(it, slice):
            start, stop, step = it.indices(size) if (it.step is None or it.step > 0) else (0, 0, 0)
            if step <= 0:
                raise ValueError("step must be greater than zero")
            n = max(0, _ceil_div(stop - start, step))
            sel.append((start, step, n))
            out_shape.append(n)
            continue
        if isinstance(it, bool) or it is None:
            raise TypeError(f"unsupported index {it!r}: use ints, slices and Ellipsis")
        try:
            i = operator.index(it)
        except TypeError:
            raise TypeError(f"unsupported index {it!r}: use ints, slices and Ellipsis") from None
        if not -size <= i < size:
            raise IndexError(f"index {i} is out of bounds for dimension {dim} with size {size}")
        sel.append((i % size, 1, 1))
    return sel, out_shape


def copy_selection(files: ChunkBackend, info: EntryInfo, sel: list[tuple[int, int, int]]) -> torch.Tensor:
    """A new tensor holding the selection (start, step, count per dim) of ``info``, copied from every
    chunk that ``files`` (a chunk backend) returns and the selection touches (only those parts)."""
    out = torch.empty([n for _, _, n in sel], dtype=info.dtype)
    if out.numel() == 0:
        return out
    for c in info.chunks:
        src, dst = [], []
        for (start, step, n), off, size in zip(sel, c.offsets, c.sizes):
            k0, k1 = max(0, _ceil_div(off - start, step)), min(n, _ceil_div(off + size - start, step))
            if k0 >= k1:
                break
            src.append(slice(start + k0 * step - off, start + (k1 - 1) * step - off + 1, step))
            dst.append(slice(k0, k1))
        else:
            out[tuple(dst)].copy_(files.region(info, c, tuple(src)))
    return out


def read_region(f: StoredFile, offset: int, dtype: torch.dtype, shape: tuple[int, ...], index: tuple[slice, ...],
                *, entry: str | None = None) -> torch.Tensor:
    """``tensor[index]`` (one slice per dimension, positive steps) of the C-contiguous tensor of ``dtype`` and
    ``shape`` stored at ``offset`` of ``f`` (a file without a mapping), in a new tensor: only the bytes of
    the elements selected are read, as the selection's contiguous runs, together (``StoredFile.read_batch``:
    on an object store, runs close together join into one ranged GET; reading/fetches.py)."""
    return FetchReads(f).materialize(placeholder(offset, dtype, shape)[index], entry)


def read_selection(files: ChunkBackend, info: EntryInfo, sel: list[tuple[int, int, int]]) -> torch.Tensor:
    """:func:`copy_selection`, then the files checked unchanged (the chunks tile the tensor: format/tiling.py)."""
    out = copy_selection(files, info, sel)
    files.check_unchanged(info.chunks)
    return out


def read_tensor(files: ChunkBackend, info: EntryInfo) -> torch.Tensor:
    """The whole tensor ``info``: its one chunk as the backend gives it (a view where it can), or assembled."""
    c = info.whole
    if c is not None:
        return files.chunk(info, c)
    return read_selection(files, info, [(0, 1, s) for s in info.shape or ()])
