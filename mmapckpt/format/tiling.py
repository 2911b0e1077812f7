"""The checks every reader runs on an index before it reads a byte: shapes torch can make,
chunks that tile their tensor exactly, and stored byte ranges that never alias but as tied weights.

**Tiling.** A tensor's chunks must cover every element exactly once: a gap would leave a
target's old values in place (or, in a freshly allocated tensor, whatever memory held), an
overlap would let one stored value win over another. The check is linear in the chunks but
for one sort, rather than pairwise: the indicator function of a box ``[a, b)`` in ``d``
dimensions is a signed sum of ``2**d`` orthants, one at each corner (``+`` or ``-`` by how
many of its coordinates are ends)::

    1[a <= x < b] = sum over corners c of sign(c) * H(x - c),   H(y) = 1 if every y_i >= 0

Orthants at distinct points are linearly independent, so the chunks' indicators add up to
the tensor's (every element covered exactly once) if and only if their signed corners,
summed point by point, equal the tensor's own: ``+1`` or ``-1`` at its ``2**d`` corners and
zero everywhere else. Only the dimensions some chunk does not span whole take part, and the
sums are made with whole-array operations (one sort of the corners). Where ``2**d`` times
the chunk count would be too much work (many chunks split over many dimensions, which no
DCP layout produces), a sweep over one dimension looks for an overlapping pair instead,
within a bound on the comparisons it makes; past the bound the layout is refused as too
complex to check rather than loaded unchecked.

**Aliasing.** Stored records (file, offset, length) may share bytes only as *exact aliases*:
the same range under two names whose tensors are stored identically (same dtype, shape and
chunk list: tied weights, format/aliases.py), which every loader gives back as one tensor.
Any other sharing (two chunks of one tensor at the same bytes, partly overlapping ranges, an
alias of a single chunk of another tensor) would let a small file stand for far more data
than it holds, and is refused: what a loader allocates never exceeds what the files hold.

**Shapes.** A zero-element tensor can claim any dimensions; torch cannot make one whose
strides overflow 64 bits. :func:`shape_fits` refuses those everywhere a shape is read.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from ..errors import EntryBoundsError, FormatError
from .entries import ChunkInfo, EntryInfo

__all__ = ["MAX_CORNER_WORK", "MAX_SWEEP_WORK", "shape_fits", "shape_problem", "tiling_problem", "check_entries"]

_MAX_INT = 2**63 - 1
#: chunks x 2**(split dimensions) above which the corner sum gives way to the sweep
MAX_CORNER_WORK = 1 << 22
#: pairwise comparisons the sweep may make before the layout is refused as too complex to check
MAX_SWEEP_WORK = 1 << 24


def shape_fits(shape: Sequence[int]) -> bool:
    """Whether torch can make a tensor of ``shape``: every dimension and every stride in [0, 2**63).

    Strides are products of the later dimensions, a zero dimension counting as one, so their
    largest is at most the product of all dimensions counted that way.
    """
    n = 1
    for s in shape:
        if s < 0:
            return False
        if s > 1:
            n *= s
            if n > _MAX_INT:
                return False
    return True


def shape_problem(shape: Sequence[int]) -> str | None:
    """What is wrong with ``shape`` (as :func:`shape_fits` judges), or None."""
    if shape_fits(shape):
        return None
    return (f"shape {list(shape)} has no valid strides: its dimensions multiply past 2**63 - 1 "
            "(a zero dimension holds no elements but does not make the others fit)")


def _numel(sizes: Sequence[int]) -> int:
    n = 1
    for s in sizes:
        n *= s
    return n


def tiling_problem(shape: Sequence[int], chunks: Sequence[tuple[Sequence[int], Sequence[int]]]) -> str | None:
    """What keeps ``chunks`` ((offsets, sizes) pairs) from covering a tensor of ``shape``
    exactly once, or None when they do. Linear in the chunks, but for a sort, for every
    layout DCP writes; whole-array operations, so about a microsecond a chunk."""
    nd = len(shape)
    if not chunks:
        return None if _numel(shape) == 0 else f"the chunks hold 0 of the tensor's {_numel(shape)} elements"
    try:
        off = np.array([o for o, _ in chunks], dtype=np.int64).reshape(len(chunks), nd)
        sz = np.array([z for _, z in chunks], dtype=np.int64).reshape(len(chunks), nd)
    except ValueError:  # ragged: some chunk has another number of dimensions
        o, z = next((o, z) for o, z in chunks if len(o) != nd or len(z) != nd)
        return f"chunk {list(o)}+{list(z)} does not have the tensor's {nd} dimensions"
    with np.errstate(over="ignore"):
        end = off + sz  # a sum past 2**63 wraps below its offset: found outside below
    size = np.array(shape, dtype=np.int64).reshape(nd)
    outside = ((off < 0) | (sz < 0) | (end > size) | (end < off)).any(axis=1)
    if outside.any():
        i = int(np.flatnonzero(outside)[0])
        return f"chunk {list(chunks[i][0])}+{list(chunks[i][1])} lies outside the tensor {list(shape)}"
    counts = sz.prod(axis=1)  # inside a tensor whose dimensions multiply below 2**63: no wrap
    live = np.flatnonzero(counts)  # empty chunks hold nothing: harmless
    want = _numel(shape)
    total = int(counts.sum()) if float(counts.sum(dtype=np.float64)) < 2**62 else sum(counts.tolist())
    if total != want:
        return f"the chunks hold {total} of the tensor's {want} elements"
    if len(live) < 2:
        return None
    off, end = off[live], end[live]
    split = np.flatnonzero(((off != 0) | (end != size)).any(axis=0)).tolist()
    if len(live) << len(split) <= MAX_CORNER_WORK and _corners_cancel(size[split], off[:, split], end[:, split]):
        return None
    pair = _overlapping_pair([(tuple(chunks[i][0]), tuple(chunks[i][1])) for i in live.tolist()], split)
    if pair is None:  # equal volumes and no two overlapping: they tile it
        return None
    if pair is _TOO_MUCH:
        return (f"{len(live)} chunks split over {len(split)} dimensions: too complex a layout to check "
                f"(over {MAX_SWEEP_WORK} comparisons); no writer of DCP checkpoints lays chunks out so")
    a, b = pair
    return f"chunks at {list(a[0])} and {list(b[0])} overlap (and, their volumes adding up, leave a gap)"


def _corners(start: np.ndarray, stop: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every corner of every box (rows of ``start``/``stop``) and its sign: ``2**k`` rows a box."""
    n, k = start.shape
    pts = np.empty((n, 1 << k, k), dtype=np.int64)
    sign = np.ones((n, 1 << k), dtype=np.int64)
    for j in range(k):
        at_end = (np.arange(1 << k) >> j) & 1 == 1
        pts[:, :, j] = np.where(at_end, stop[:, j:j + 1], start[:, j:j + 1])
        sign[:, at_end] *= -1
    return pts.reshape(-1, k), sign.reshape(-1)


def _summed(pts: np.ndarray, sign: np.ndarray, size: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct corner points (rows) and each one's summed sign, by one sort: of one integer a
    point where the mixed-radix number of its coordinates fits 63 bits (always, but for
    tensors of about 2**63 elements), else of the rows, column by column."""
    radix = [int(x) + 1 for x in size.tolist()]
    if math.prod(radix) < 2**62:
        key = np.zeros(len(pts), dtype=np.int64)
        for j, r in enumerate(radix):
            key = key * r + pts[:, j]
        order = np.argsort(key, kind="stable")
        p, s = pts[order], sign[order]
        new = np.empty(len(p), dtype=bool)
        new[0] = True
        np.not_equal(key[order][1:], key[order][:-1], out=new[1:])
    else:
        order = np.lexsort(pts.T[::-1])
        p, s = pts[order], sign[order]
        new = np.empty(len(p), dtype=bool)
        new[0] = True
        np.any(p[1:] != p[:-1], axis=1, out=new[1:])
    starts = np.flatnonzero(new)
    return p[starts], np.add.reduceat(s, starts)


def _corners_cancel(size: np.ndarray, start: np.ndarray, stop: np.ndarray) -> bool:
    """Whether the boxes' signed corners, summed point by point, are the box ``[0, size)``'s own."""
    pts, sums = _summed(*_corners(start, stop), size)
    keep = sums != 0
    want_pts, want_sign = _corners(np.zeros((1, len(size)), dtype=np.int64), size.reshape(1, -1))
    if int(keep.sum()) != len(want_pts):
        return False
    got = dict(zip(map(tuple, pts[keep].tolist()), sums[keep].tolist()))
    return all(got.get(tuple(p)) == w for p, w in zip(want_pts.tolist(), want_sign.tolist()))


_TOO_MUCH = object()


def _overlapping_pair(live: list[tuple[tuple[int, ...], tuple[int, ...]]], split: list[int]) -> Any:
    """Two overlapping chunks, found by a sweep along the split dimension with the most distinct
    starts; None if no two overlap, ``_TOO_MUCH`` if the comparisons run past MAX_SWEEP_WORK."""
    if not split:
        return live[0], live[1]  # every chunk is the whole tensor
    d = max(split, key=lambda k: len({o[k] for o, _ in live}))
    order = sorted(live, key=lambda c: c[0][d])
    active: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    work = 0
    for c in order:
        start = c[0][d]
        active = [a for a in active if a[0][d] + a[1][d] > start]
        work += len(active) + 1
        if work > MAX_SWEEP_WORK:
            return _TOO_MUCH
        for a in active:
            if all(a[0][k] < c[0][k] + c[1][k] and c[0][k] < a[0][k] + a[1][k] for k in split):
                return a, c
        active.append(c)
    return None


def _alias_key(e: EntryInfo) -> tuple[Any, ...]:
    return (e.kind, e.dtype_name, e.shape, e.chunks)


def _label(e: EntryInfo, c: ChunkInfo) -> str:
    return e.name if e.kind != "tensor" or c.sizes == e.shape else f"{e.name}@{list(c.offsets)}"


def check_entries(entries: Iterable[EntryInfo], path: str) -> None:
    """Refuse an index whose shapes torch cannot make, whose chunks do not tile their tensor, or
    whose stored byte ranges alias other than as tied weights (see the module docstring).

    Raises:
        FormatError: a shape or a tiling defect, naming ``path`` and the entry.
        EntryBoundsError: stored byte ranges that overlap, naming both entries.
    """
    recs: list[tuple[str, int, int, int]] = []  # (file, start, end, number): sorted as plain tuples
    owners: list[tuple[EntryInfo, ChunkInfo]] = []
    for e in entries:
        if e.kind == "tensor":
            shape = e.shape or ()
            bad = shape_problem(shape)
            if bad is None and not (len(e.chunks) == 1 and e.chunks[0].sizes == shape and not any(e.chunks[0].offsets)):
                bad = tiling_problem(shape, [(c.offsets, c.sizes) for c in e.chunks])
            if bad is not None:
                raise FormatError(bad, path=path, entry=e.name)
        for c in e.chunks:
            if c.length and c.file_offset >= 0:  # a torch.save file's negative offsets are torch's own layout
                recs.append((c.file, c.file_offset, c.file_offset + c.length, len(owners)))
                owners.append((e, c))
    _check_ranges(recs, owners, path)


def _check_ranges(recs: list[tuple[str, int, int, int]], owners: list[tuple[EntryInfo, ChunkInfo]],
                  path: str) -> None:
    recs.sort()
    prev = None
    for r in recs:
        if prev is not None and r[0] == prev[0] and r[1] < prev[2]:
            (e, c), (pe, pc) = owners[r[3]], owners[prev[3]]
            where = f"{r[0]} bytes [{r[1]}, {r[2]})"
            if (r[1], r[2]) != (prev[1], prev[2]):
                raise EntryBoundsError(f"its stored data ({where}) overlaps that of {_label(pe, pc)!r}; the metadata "
                                       "is damaged or crafted", path=path, entry=_label(e, c))
            if e.name == pe.name:
                raise EntryBoundsError(f"two of its chunks ({list(pc.offsets)} and {list(c.offsets)}) are stored at "
                                       f"the same bytes ({where}); the metadata is damaged or crafted",
                                       path=path, entry=e.name)
            if e.kind != "tensor" or _alias_key(e) != _alias_key(pe):
                raise EntryBoundsError(f"its stored data ({where}) is also {_label(pe, pc)!r}'s, but the two are not "
                                       "tied weights (the same dtype, shape and chunks); the metadata is damaged or "
                                       "crafted", path=path, entry=_label(e, c))
        if prev is None or r[0] != prev[0] or r[2] > prev[2]:
            prev = r
