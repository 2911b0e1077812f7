"""Regions of a tensor stored as chunks: basic indexing turned into a selection, and the selection copied.

``get_slice(name)[index]`` takes ints (negative too), slices with positive steps and one
Ellipsis over the global shape; each chunk contributes only the part the selection
touches (``ChunkBackend.region``), so only those pages of the file are read, or, on a
medium without mappings, only those byte ranges (:func:`read_region`).
"""

from __future__ import annotations

import itertools
import operator
from typing import Any

import torch

from ..format.entries import EntryInfo
from ..storage.base import StoredFile
from .backend import ChunkBackend

__all__ = ["GAP_BYTES", "copy_selection", "normalize_index", "read_region", "read_selection", "read_tensor"]

#: Bytes between two ranges a selection needs below which :func:`read_region` reads both as one range
#: (a request to an object store costs more than reading that much); farther apart, they are read apart.
GAP_BYTES = 1 << 20


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
    ``shape`` stored at ``offset`` of ``f``, read through ``f.read_into``: only the byte ranges the selection
    needs, in a new tensor.

    The selection is read as one range per index of its outer dimensions down to the innermost one
    whose consecutive blocks lie more than :data:`GAP_BYTES` apart (none: one range, from the first
    element selected to the last), so that rows of a matrix cost their bytes and a few columns of one
    cost a range per row only where rows are long.
    """
    item, n = dtype.itemsize, len(shape)
    ranges = [range(*sl.indices(size)) for sl, size in zip(index, shape)]
    counts = [len(r) for r in ranges]
    out = torch.empty(counts, dtype=dtype)
    if out.numel() == 0:
        return out
    strides = [1] * n
    for d in range(n - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    apart = [r.step * s for r, s in zip(ranges, strides)]  # elements between consecutive selected indices
    span = [1] * (n + 1)  # span[d]: elements from the first to the last selected of dimensions d..n-1
    for d in range(n - 1, -1, -1):
        span[d] = (counts[d] - 1) * apart[d] + span[d + 1]
    split = 0  # ranges are read per index of dimensions < split
    for d in range(n):
        if counts[d] > 1 and (apart[d] - span[d + 1]) * item > GAP_BYTES:
            split = d + 1
    first = sum(r.start * s for r, s in zip(ranges, strides))
    buf = torch.empty(span[split], dtype=dtype)
    raw = buf.view(torch.uint8).numpy()
    block = buf.as_strided(counts[split:], apart[split:])
    for at in itertools.product(*(range(c) for c in counts[:split])):
        start = first + sum(i * a for i, a in zip(at, apart))
        f.read_into(offset + start * item, raw, entry=entry)
        out[at].copy_(block)
    return out


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
