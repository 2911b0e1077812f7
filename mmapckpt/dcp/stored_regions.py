"""A stored record's bytes as one flat uint8 tensor: what a read-once reader rank sends.

An mmapckpt chunk is a view over the mapped shard (checked against the shard header as
the plain read path checks it, its CRC-32 verified first with ``verify=True``); a stock
item is read and loaded with ``weights_only=True`` and must have the dtype and shape the
metadata gives its chunk; a non-tensor value is its stored bytes. Pages of a mapped chunk
are read from storage when the bytes are sent, once.
"""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex

from ..errors import FormatError, SizeMismatchError
from ..format.stock import load_tensor
from ..reading.shard import Shard, check_size_unchanged
from ..storage.base import StoredFile
from .read_paths import FileReads, label

__all__ = ["StoredRegions"]


class StoredRegions:
    """The stored bytes of records, for one load; keeps the shards it mapped open until :meth:`close`."""

    def __init__(self, reads: FileReads) -> None:
        self.reads = reads
        #: file name -> (the file, its mmapckpt shard or None for a stock file)
        self._files: dict[str, tuple[StoredFile, Shard | None]] = {}

    def path_of(self, idx: MetadataIndex) -> str:
        return self.reads.storage.full(self.reads.info(idx).relative_path)

    def source(self, idx: MetadataIndex, is_bytes: bool) -> torch.Tensor:
        """The record's bytes (a non-tensor value's, or the chunk's raw bytes in row-major order)."""
        reads, info = self.reads, self.reads.info(idx)
        f, shard = self._open(info.relative_path, idx)
        path = f.path
        reads.counter.take(path, info.offset, info.length)  # sent whole (mapped pages read as they go)
        if shard is not None:
            if reads.verify:
                shard.verify(shard.entry(idx.fqn, None if is_bytes else tuple(idx.offset or ())))
            if is_bytes:
                return torch.frombuffer(bytearray(shard.object_bytes(idx.fqn, info.offset, info.length)),
                                        dtype=torch.uint8) if info.length else torch.empty(0, dtype=torch.uint8)
            dtype, sizes = reads.chunk_layout(idx, path)
            return shard.view((idx.fqn, tuple(idx.offset)), info.offset, info.length, dtype, sizes) \
                .reshape(-1).view(torch.uint8)
        buf = f.read(info.offset, info.length, entry=label(idx))
        if is_bytes:
            return torch.frombuffer(buf, dtype=torch.uint8) if len(buf) else torch.empty(0, dtype=torch.uint8)
        dtype, sizes = reads.chunk_layout(idx, path)
        t = load_tensor(buf, path=path, entry=label(idx))
        if t.dtype != dtype:
            raise FormatError(f"stored item is {t.dtype}, the metadata says {dtype}", path=path, entry=label(idx))
        if tuple(t.shape) != tuple(sizes):
            raise SizeMismatchError(f"stored item has shape {list(t.shape)}, the metadata says {list(sizes)}",
                                    path=path, entry=label(idx))
        return t.contiguous().reshape(-1).view(torch.uint8)

    def _open(self, rel: str, idx: MetadataIndex) -> tuple[StoredFile, Shard | None]:
        if rel not in self._files:
            f = self.reads.open_file(rel, label(idx))
            try:
                self._files[rel] = (f, self.reads.open_shard(f))
            except BaseException:
                f.close()
                raise
        return self._files[rel]

    def close(self) -> None:
        """Check that no mapped shard shrank while its bytes were sent, then release the files."""
        files, self._files = self._files, {}
        try:
            for _, shard in files.values():
                if shard is not None:
                    check_size_unchanged(shard)
        finally:
            for f, _ in files.values():
                f.close()
