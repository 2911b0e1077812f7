"""Staging an open checkpoint's chunks into accelerator tensors through the pinned staging pool."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Callable, Iterator

import torch

from ..io.mapped import MappedFile
from ..storage.base import StoredFile
from ..format.entries import ChunkInfo, EntryInfo
from .backend import ChunkBackend
from .moves import Moves, close_all

if TYPE_CHECKING:
    from ..io.staging import StagingPool

__all__ = ["chunk_stager"]


@contextlib.contextmanager
def chunk_stager(files: ChunkBackend, infos: list[EntryInfo]) -> Iterator[Callable[..., None]]:
    """``stage_chunk(pool, info, chunk, dst, done=None)``: one stored chunk into accelerator tensor ``dst``.

    ``files`` is an open checkpoint's backend (``LazyCheckpoint.backend``).

    Chunks that are views over a file mapping (mmapckpt shards, aligned safetensors tensors), or
    regions of a file without one (an object), are read from the file straight into the staging buffers (the staged move of
    reading/moves.py, whose reads also start the kernel's readahead on a cold file); others
    (stock items, torch.save tensors, misaligned safetensors tensors) are built on the CPU
    and then staged. Used by ``load(device=...)`` and ``load_into`` with accelerator targets.
    """
    chunks = [c for info in infos for c in info.chunks]
    ranges: dict[str, tuple[MappedFile | StoredFile, list[tuple[int, int]]]] = {}
    for info in infos:
        for c in info.chunks:
            mapped = files.mapped(info, c)
            if mapped is not None and c.length:
                ranges.setdefault(c.file, (mapped, []))[1].append((c.file_offset, c.length))
    pools: dict[torch.device, StagingPool] = {}
    moves = {rel: Moves(m, ranges=sorted(r), pool_for=pools.__getitem__, stage_all=True)
             for rel, (m, r) in ranges.items()}
    memory = Moves(None, pool_for=pools.__getitem__, stage_all=True)

    def stage_chunk(pool: StagingPool, info: EntryInfo, c: ChunkInfo, dst: torch.Tensor,
                    done: Callable[[], None] = lambda: None) -> None:
        source = files.mapped(info, c)
        by = moves.get(c.file) if source is not None else None
        src = files.chunk(info, c, lazy=True) if by is not None and isinstance(source, StoredFile) else \
            files.chunk(info, c)
        pools[dst.device] = pool
        (by or memory).move(src, dst, lambda: info.name, done)

    ok = False
    try:
        yield stage_chunk
        ok = True
    finally:
        close_all((*moves.values(), memory), ok=ok)  # the pools read late: sealed before the files close
    files.check_unchanged(chunks)
