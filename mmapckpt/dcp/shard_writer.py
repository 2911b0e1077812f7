"""The DCP side of writing shards: a rank's WriteItems to the shard files (writing/files.py) and back.

The writer (writer.py) decides which items go to which file and commits the metadata; this
module resolves each file's non-tensor payloads, turns its items into the shard writer's
entries (tensors resolved through the planner, in order, when their turn comes), and the
written entries into DCP's WriteResults with their (file, offset, length) storage records.
"""

from __future__ import annotations

import functools
import io
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.planner import SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from ..errors import CheckpointWriteError
from ..format import layout as fmt
from ..format.aliases import item_aliases
from ..format.transforms import StreamTransforms
from ..storage.base import CheckpointStorage
from ..writing.dedup import Reference, ReuseIndex
from ..writing.files import write_files as write_shard_files
from ..writing.shard import ShardEntry, ShardOptions, shard_error
from .plan_items import write_result
from .storable import CHECKED_ATTR, check_storable

__all__ = ["WriterOptions", "write_files", "chunk_nbytes"]


@dataclass(frozen=True)
class WriterOptions:
    thread_count: int = 1
    sync_files: bool = True
    alignment: int = 4096
    overwrite: bool = True
    direct_io: bool = True
    #: DCP stream transforms every item is written through (``_extensions``); none: raw, mappable entries
    transforms: StreamTransforms | None = None

    def __post_init__(self) -> None:
        if self.thread_count < 1:
            raise ValueError(f"thread_count must be >= 1, got {self.thread_count}")
        self.shard  # validates the alignment

    @functools.cached_property
    def shard(self) -> ShardOptions:
        """How each shard file is written (writing/shard.py)."""
        return ShardOptions(self.alignment, self.direct_io, self.sync_files, self.transforms)


def chunk_nbytes(item: WriteItem) -> int:
    td = item.tensor_data
    assert td is not None  # a TENSOR/SHARD item always has tensor_data (DCP invariant, not file content)
    n = 1
    for s in td.chunk.sizes:
        n *= s
    return n * torch._utils._element_size(td.properties.dtype)


def write_files(storage: CheckpointStorage, files: list[tuple[str, list[WriteItem]]], planner: SavePlanner,
                save_id: str, options: WriterOptions, write_paths: dict[str, str],
                reuse: ReuseIndex | None = None) -> list[WriteResult]:
    """Write one rank's shard files (writing/files.py: ``thread_count`` at a time, then the directory made durable,
    and the finished files removed again if any fails); their items' WriteResults, with (file, offset, length).

    ``write_paths`` receives each finished file's write path. ``reuse``: hash every chunk, and record the chunks
    equal to ones it holds as references to their stored bytes instead of writing them (writing/dedup.py).
    """
    if not getattr(planner, CHECKED_ATTR, False):
        planner = _Checked(planner, storage.location)  # type: ignore[assignment]
    shards = []
    for name, items in files:
        try:
            entries = _entries(items, planner, storage.location)
        except BaseException as e:  # a payload the planner could not give: typed as the shard writer types it
            typed = shard_error(e, storage.full(name))
            if typed is e:
                raise
            raise typed from e
        aliases = None if options.transforms is not None else item_aliases([it.index for it in items], planner)
        shards.append((name, entries, aliases))
    done = write_shard_files(storage, shards, planner.resolve_data, save_id=save_id, options=options.shard,
                             thread_count=options.thread_count, write_paths=write_paths, reuse=reuse)
    return [write_result(it.index, e.length, _StorageInfo(e.file, e.offset, e.length) if type(e) is Reference else
                         _StorageInfo(name, e.offset, e.length, list(e.transforms) if e.transforms else None))
            for (name, items), written in zip(files, done) for e, it in zip(written, items)]


class _Checked:
    """``planner``, whose ``resolve_data`` refuses a tensor no checkpoint can hold (storable.py), naming it."""

    def __init__(self, planner: SavePlanner, directory: str) -> None:
        self._planner, self._directory = planner, directory

    def resolve_data(self, item: WriteItem) -> Any:
        data = self._planner.resolve_data(item)
        if isinstance(data, torch.Tensor):
            check_storable(item.index.fqn, data, self._directory)
        return data

    def __getattr__(self, name: str) -> Any:  # the rest (tied-weight records, ...) is the planner's
        return getattr(self._planner, name)


def _entries(items: list[WriteItem], planner: SavePlanner, directory: str) -> list[ShardEntry]:
    """The shard writer's entries for ``items``: BYTE_IO payloads (small) resolved now, to know every size;
    tensors by their planned chunk, resolved by the shard writer through ``planner.resolve_data``."""
    out = []
    for it in items:
        if it.type == WriteItemType.BYTE_IO:
            data = planner.resolve_data(it)
            payload = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data)
            out.append(ShardEntry(it.index.fqn, None, fmt.KIND_BYTES, None, (), len(payload), payload))
        else:
            td = it.tensor_data
            sizes, dtype = td.chunk.sizes, td.properties.dtype
            out.append(ShardEntry(it.index.fqn, tuple(td.chunk.offsets), fmt.KIND_TENSOR,
                                  _dtype_name(it, dtype, directory), tuple(sizes),
                                  math.prod(sizes) * dtype.itemsize, it))
    return out


def _dtype_name(it: WriteItem, dtype: torch.dtype, directory: str) -> str:
    try:
        return fmt.dtype_name(dtype)
    except ValueError:
        raise CheckpointWriteError(f"cannot save this tensor: it has dtype {dtype}, which the mmapckpt format "
                                   "cannot store (docs/format.md, section 2.4)", path=directory,
                                   entry=it.index.fqn) from None
