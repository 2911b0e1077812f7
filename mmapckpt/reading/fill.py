"""Filling CPU tensors with stored tensors, each read by its file's strategy (``load_into``; ``load`` from objects).

A tensor stored whole as a view over a mapped file, or as a region of an unmapped one (an
object), moves by its file's :class:`~mmapckpt.reading.moves.Moves`: a direct read into a
contiguous target, gathered per file and run together at the end (``preadv`` batches locally,
parallel ranged GETs on an object store); the others are assembled from their chunks and copied.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..format.entries import ChunkInfo, EntryInfo
from ..io.mapped import MappedFile
from ..storage.base import StoredFile
from .backend import ChunkBackend
from .moves import Moves, close_all

__all__ = ["fill_targets"]


def fill_targets(files: ChunkBackend, plan: Sequence[tuple[str, torch.Tensor, EntryInfo]]) -> None:
    """Copy each ``(name, target, info)`` of ``plan``: the stored tensor ``info`` of ``files`` into CPU ``target``.

    Per tensor only what its move needs: its one chunk and mapping looked up once, the targets' moves grouped
    by file, a target detached only where it requires grad (a detached copy is a new tensor object).
    """
    # per file: its mapping (or the file, for an object), the (offset, length) of its regions, its items
    by_file: dict[str, tuple[MappedFile | StoredFile, list[tuple[int, int]], list[tuple[str, torch.Tensor, EntryInfo,
                                                                                       ChunkInfo]]]] = {}
    assembled = []  # assembled from their chunks, or stock items
    for item in plan:
        info = item[2]
        c = info.whole
        mapped = files.mapped(info, c) if c is not None else None
        if mapped is None:
            assembled.append(item)
            continue
        group = by_file.get(c.file)  # type: ignore[union-attr]
        if group is None:
            group = by_file[c.file] = (mapped, [], [])  # type: ignore[union-attr]
        group[1].append((c.file_offset, c.length))  # type: ignore[union-attr]
        group[2].append((item[0], item[1], info, c))  # type: ignore[arg-type]
    moves = {rel: Moves(mapped, ranges=sorted(ranges)) for rel, (mapped, ranges, _) in by_file.items()}
    ok = False
    try:
        chunk = files.chunk
        for rel, (mapped, _, items) in by_file.items():
            move = moves[rel].move
            if isinstance(mapped, StoredFile):  # no mapping: placeholders, read at finish
                for name, t, info, c in items:
                    move(chunk(info, c, lazy=True), t.detach() if t.requires_grad else t, lambda: name, _nothing)
            else:
                for name, t, info, c in items:
                    move(chunk(info, c), t.detach() if t.requires_grad else t, lambda: name, _nothing)
        if assembled:  # the assembly of chunks (reading/regions.py) is imported by the loads that have some
            from .regions import read_tensor

        memory = Moves(None)
        for name, t, info in assembled:
            memory.move(read_tensor(files, info), t.detach() if t.requires_grad else t, lambda: name, _nothing)
        for m in moves.values():
            m.finish()
        ok = True
    finally:
        close_all(moves.values(), ok=ok)
    files.check_unchanged(c for _, _, info in plan for c in info.chunks)


def _nothing() -> None:
    pass
