"""MmapReader's read path for tensor chunks stored as safetensors data (reading/dcp_safetensors.py).

A Hugging Face directory's files (metadata from dcp/safetensors_metadata.py: each record is
the chunk's bytes in its file), and stock DCP shards written with
``FileSystemWriter(serialization_format=SAFETENSORS)`` (each tensor record is the offset
where the shard's safetensors data starts). Either way each chunk is found by name in the
header, checked against the metadata, viewed over the file's mapping, narrowed to the region
asked for and moved into the planner's target as an mmapckpt chunk is (reading/moves.py:
``preadv`` straight into contiguous CPU targets, staging for accelerators, else a copy).
A chunk at an offset that is not a multiple of its element size is copied into memory first.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadPlanner, ReadItem

from ..errors import FormatError, IncompleteCheckpointError
from ..reading.dcp_safetensors import SafetensorsChunks, stock_safetensors
from ..reading.moves import Moves
from ..storage.base import StoredFile

__all__ = ["chunk_bytes", "label", "locate", "read_safetensors", "safetensors_in"]

Job = tuple[ReadItem, _StorageInfo]


def safetensors_in(reads: Any, f: StoredFile, first: tuple[MetadataIndex, _StorageInfo] | None,
                   whole_file: bool) -> SafetensorsChunks | None:
    """The safetensors data of ``f`` its tensor items are read from: the whole file (``whole_file``: a Hugging
    Face directory's), or what starts where the first tensor item ``first`` (its index and record) of a stock
    shard is recorded, where that record can be one (None: torch.save items; ``reads``: the load's FileReads)."""
    if whole_file:
        return SafetensorsChunks(f, 0)
    if first is None or first[0].offset is None:
        return None
    dtype, sizes = reads.chunk_layout(first[0], f.path)
    return stock_safetensors(f, first[1].offset, first[1].length, dtype, tuple(sizes))


def label(idx: MetadataIndex) -> str:
    return idx.fqn if idx.offset is None else f"{idx.fqn}@{list(idx.offset)}"


def locate(reads: Any, st: SafetensorsChunks, idx: MetadataIndex, info: _StorageInfo,
           whole_file: bool) -> tuple[torch.dtype, Any, int, int]:
    """(dtype, shape, file offset, length) of the stored chunk ``idx`` (with its record ``info``) in ``st``,
    checked against the metadata (see :func:`read_safetensors`)."""
    name, path = label(idx), st.path
    if idx.offset is None:
        raise FormatError("a non-tensor record points at safetensors data", path=path, entry=name)
    dtype, sizes = reads.chunk_layout(idx, path)
    offset, length = st.locate(idx.fqn, tuple(idx.offset), dtype, tuple(sizes), name)
    if whole_file and (offset, length) != (info.offset, info.length):
        raise IncompleteCheckpointError(f"the file holds the tensor at bytes [{offset}, +{length}), not "
                                        f"[{info.offset}, +{info.length}) as when the metadata was read: it was "
                                        "rewritten meanwhile; load again", path=path, entry=name)
    if not whole_file and info.offset != st.st.base:
        raise FormatError(f"tensor records of this shard start at {st.st.base} and {info.offset}", path=path,
                          entry=name)
    return dtype, sizes, offset, length


def chunk_bytes(reads: Any, st: SafetensorsChunks, idx: MetadataIndex, info: _StorageInfo,
                whole_file: bool) -> torch.Tensor:
    """The stored chunk ``idx``'s bytes as one flat uint8 tensor (over the mapping where it can): what a
    read-once load sends (dcp/deliver.py)."""
    dtype, sizes, offset, length = locate(reads, st, idx, info, whole_file)
    reads.counter.take(st.path, offset, length)
    return st.view(offset, length, dtype, sizes).reshape(-1).view(torch.uint8)


def read_safetensors(reads: Any, st: SafetensorsChunks, jobs: list[Job], planner: LoadPlanner, memory: Moves, *,
                     defer: bool, whole_file: bool) -> None:
    """Read the tensor items ``jobs`` (each with its record) out of ``st`` into the planner's targets.

    ``reads`` is the load's ``FileReads`` (dcp/read_paths.py); ``memory`` its moves of sources in
    memory; ``defer``: whether the planner lets reads be gathered and committed at the end of the file.

    Raises:
        FormatError, SizeMismatchError: a chunk the header holds otherwise than the metadata says.
        IncompleteCheckpointError: a Hugging Face file rewritten since its metadata was read.
    """
    path = st.path
    located = []
    for req, info in jobs:
        dtype, sizes, offset, length = locate(reads, st, req.storage_index, info, whole_file)
        located.append((req, label(req.storage_index), dtype, sizes, offset, length))
    moves = Moves(st.source, read=reads.direct_reads and defer,
                  ranges=[(o, n) for _, _, dt, _, o, n in located if st.aligned(o, dt)],
                  pool_for=reads.pool_for, stage_all=reads.stage_cpu)
    lazy = defer and st.st.file is None
    accept_view = getattr(planner, "accept_view", None)
    taken: list[tuple[int, int, int | None]] = []
    ok = False
    try:
        for req, name, dtype, sizes, offset, length in located:
            view = st.view(offset, length, dtype, sizes, lazy=lazy)
            if accept_view is not None:
                if lazy:
                    view = moves.fetches.materialize(view, name)  # type: ignore[union-attr]
                if accept_view(req, view):
                    continue
            part = dtype.itemsize
            for s in req.lengths:
                part *= s
            taken.append((offset, length, part))
            # A copied (misaligned) chunk is no view of the mapping: moved as memory, never read by offset.
            reads.copy_region(view, req, planner, path, moves if st.aligned(offset, dtype) else memory, defer)
        moves.finish()
        ok = True
    finally:
        moves.close(ok=ok)
        reads.counter.take_all(path, taken)
    st.st.stored.check_unchanged()
