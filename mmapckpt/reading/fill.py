"""Filling CPU tensors with stored tensors, each read by its file's strategy (``load_into``; ``load`` from objects).

A tensor stored whole as a view over a mapped file, or as a region of an unmapped one (an
object), moves by its file's :class:`~mmapckpt.reading.moves.Moves`: a direct read into a
contiguous target, gathered per file and run together at the end (``preadv`` batches locally,
parallel ranged GETs on an object store); the others are assembled from their chunks and copied.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..format.entries import EntryInfo
from ..io.mapped import MappedFile
from ..storage.base import StoredFile
from .backend import ChunkBackend
from .moves import Moves, close_all
from .regions import read_tensor

__all__ = ["fill_targets"]


def fill_targets(files: ChunkBackend, plan: Sequence[tuple[str, torch.Tensor, EntryInfo]]) -> None:
    """Copy each ``(name, target, info)`` of ``plan``: the stored tensor ``info`` of ``files`` into CPU ``target``."""
    ranges: dict[str, tuple[MappedFile | StoredFile, list[tuple[int, int]]]] = {}
    direct: set[str] = set()  # names whose one chunk is a view over a mapped file, or a region of an object
    for name, _, info in plan:
        c = info.whole
        mapped = files.mapped(info, c) if c is not None else None
        if mapped is not None:
            ranges.setdefault(c.file, (mapped, []))[1].append((c.file_offset, c.length))  # type: ignore[union-attr]
            direct.add(name)
    moves = {rel: Moves(m, ranges=sorted(r)) for rel, (m, r) in ranges.items()}
    memory = Moves(None)
    ok = False
    try:
        for name, t, info in plan:
            if name in direct:
                c = info.whole
                unmapped = isinstance(ranges[c.file][0], StoredFile)  # type: ignore[union-attr]
                src = files.chunk(info, c, lazy=True) if unmapped else files.chunk(info, c)  # type: ignore[arg-type]
                moves[c.file].move(src, t.detach(), lambda: name, _nothing)  # type: ignore[union-attr]
            else:  # assembled from its chunks, or a stock item
                memory.move(read_tensor(files, info), t.detach(), lambda: name, _nothing)
        for m in moves.values():
            m.finish()
        ok = True
    finally:
        close_all(moves.values(), ok=ok)
    files.check_unchanged(c for _, _, info in plan for c in info.chunks)


def _nothing() -> None:
    pass
