"""A stored record's bytes as one flat uint8 tensor: what a read-once reader rank sends.

An mmapckpt chunk is a view over the mapped shard (checked against the shard header as
the plain read path checks it, its CRC-32 verified first with ``verify=True``); a stock
item is read and loaded with ``weights_only=True`` and must have the dtype and shape the
metadata gives its chunk; a non-tensor value is its stored bytes. Pages of a mapped chunk
are read from storage when the bytes are sent, once.
"""

from __future__ import annotations

import os

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex

from ..errors import FormatError, IncompleteCheckpointError, SizeMismatchError
from ..format.metadata import KIND_MMAPCKPT, missing_shard_error
from ..format.shard import Shard, check_size_unchanged, is_mmapckpt_shard
from ..format.stock import load_tensor, read_item
from ..io.files import open_inside
from .read_paths import FileReads, label

__all__ = ["StoredRegions"]


class StoredRegions:
    """The stored bytes of records, for one load; keeps the shards it mapped open until :meth:`close`."""

    def __init__(self, reads: FileReads) -> None:
        self.reads = reads
        self._shards: dict[str, Shard | None] = {}  # path -> mapped shard, None for a stock file

    def path_of(self, idx: MetadataIndex) -> str:
        return open_inside(self.reads.root, self.reads.info(idx).relative_path)

    def source(self, idx: MetadataIndex, is_bytes: bool) -> torch.Tensor:
        """The record's bytes (a non-tensor value's, or the chunk's raw bytes in row-major order)."""
        reads, info, path = self.reads, self.reads.info(idx), self.path_of(idx)
        shard = self._open(path, idx)
        reads.counter.take(path, info.offset, info.length)  # sent whole (mapped pages read as they go)
        if shard is not None:
            if reads.verify:
                shard.verify(shard.entry(idx.fqn, None if is_bytes else tuple(idx.offset or ())))
            if is_bytes:
                return torch.frombuffer(bytearray(shard.object_bytes(idx.fqn, info.offset, info.length)),
                                        dtype=torch.uint8) if info.length else torch.empty(0, dtype=torch.uint8)
            dtype, sizes = reads._chunk(idx, path)
            return shard.view((idx.fqn, tuple(idx.offset)), info.offset, info.length, dtype, sizes) \
                .reshape(-1).view(torch.uint8)
        fd = os.open(path, os.O_RDONLY)
        try:
            buf = read_item(fd, info.offset, info.length, path=path, entry=label(idx))
        finally:
            os.close(fd)
        if is_bytes:
            return torch.frombuffer(buf, dtype=torch.uint8) if len(buf) else torch.empty(0, dtype=torch.uint8)
        dtype, sizes = reads._chunk(idx, path)
        t = load_tensor(buf, path=path, entry=label(idx))
        if t.dtype != dtype:
            raise FormatError(f"stored item is {t.dtype}, the metadata says {dtype}", path=path, entry=label(idx))
        if tuple(t.shape) != tuple(sizes):
            raise SizeMismatchError(f"stored item has shape {list(t.shape)}, the metadata says {list(sizes)}",
                                    path=path, entry=label(idx))
        return t.contiguous().reshape(-1).view(torch.uint8)

    def _open(self, path: str, idx: MetadataIndex) -> Shard | None:
        if path in self._shards:
            return self._shards[path]
        reads = self.reads
        if not os.path.exists(path):
            raise missing_shard_error(reads.root, path, reads.save_id, label(idx))
        shard = None
        if reads.metadata_kind == KIND_MMAPCKPT or is_mmapckpt_shard(path):
            shard = Shard(path, check_entries=False)
            if shard.save_id is not None and reads.save_id not in (None, shard.save_id):
                raise IncompleteCheckpointError(
                    f"shard was written by save {shard.save_id}, but the metadata read belongs to save "
                    f"{reads.save_id}: the checkpoint was replaced while it was being loaded", path=path)
        self._shards[path] = shard
        return shard

    def close(self) -> None:
        """Check that no mapped shard shrank while its bytes were sent, then forget the shards."""
        shards, self._shards = self._shards, {}
        for shard in shards.values():
            if shard is not None:
                check_size_unchanged(shard)
