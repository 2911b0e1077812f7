"""Staging an open checkpoint's chunks into accelerator tensors through the pinned staging pool."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch

from ..io.direct_reads import DirectReads
from ..io.staging import StagingPool, stage
from ..format.entries import ChunkInfo, EntryInfo
from .backend import ChunkBackend

__all__ = ["chunk_stager"]


@contextlib.contextmanager
def chunk_stager(files: ChunkBackend, infos: list[EntryInfo]) -> Iterator[Callable[..., None]]:
    """``stage_chunk(pool, info, chunk, dst, done=None)``: one stored chunk into accelerator tensor ``dst``.

    ``files`` is an open checkpoint's backend (``LazyCheckpoint.backend``).

    Chunks that are views over a file mapping (mmapckpt shards, aligned safetensors tensors)
    are read from the file straight into the staging buffers (``preadv`` through
    :class:`DirectReads`, which also starts the kernel's readahead on a cold file); others
    (stock items, torch.save tensors, misaligned safetensors tensors) are built on the CPU
    and then staged. Used by ``load(device=...)`` and ``load_into`` with accelerator targets.
    """
    chunks = [c for info in infos for c in info.chunks]
    ranges: dict[str, tuple[Any, list[tuple[int, int]]]] = {}
    for info in infos:
        for c in info.chunks:
            mapped = files.mapped(info, c)
            if mapped is not None and c.length:
                ranges.setdefault(c.file, (mapped, []))[1].append((c.file_offset, c.length))
    readers = {rel: DirectReads(m, ranges=sorted(r)) for rel, (m, r) in ranges.items()}
    pools: set[StagingPool] = set()

    def stage_chunk(pool: StagingPool, info: EntryInfo, c: ChunkInfo, dst: torch.Tensor,
                    done: Callable[[], None] = lambda: None) -> None:
        src = files.chunk(info, c)
        reader = readers.get(c.file) if files.mapped(info, c) is not None else None
        pools.add(pool)
        stage(pool, src, dst, done, reader.reader_for(src, info.name) if reader is not None else None)

    ok = False
    try:
        yield stage_chunk
        ok = True
    finally:
        for pool in pools:  # the pools read late: before the files close
            pool.seal(run=ok)
        for r in readers.values():
            r.close()
    files.check_unchanged(chunks)
