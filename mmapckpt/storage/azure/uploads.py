"""A shard written to Azure Blob: blocks staged as the tensors' bytes arrive, committed in one block list.

The shard writer hands pieces at ascending offsets and the head (offset 0) last. Pieces are
gathered into blocks of ``upload_part_size`` bytes (raised in MiB steps where a shard would need
more than Azure's 50,000 blocks) and each full block is staged at once (Put Block), at most
``upload_concurrency`` in flight, so memory stays within ``(upload_concurrency + 1) *
upload_part_size`` whatever the shard's size. The head is a block of its own, staged last: the
block list (Put Block List), not the staging order, places blocks in the blob, and Azure blocks
have no minimum size. A shard smaller than one block is one Put Blob. The blob appears under its
name only when the block list is committed; the blocks of a save that fails or is killed stay
uncommitted, invisible to every listing and read, and Azure discards them (after a week, or when
a blob of that name is committed or deleted).
"""

from __future__ import annotations

import base64
import uuid
from typing import Any

from ...errors import CheckpointError
from ..parts import PartedOutput, part_size_for
from .failures import FAILURES
from .options import MAX_BLOCKS

__all__ = ["BlobOutput", "block_size_for"]


def block_size_for(size: int | None, wanted: int) -> int:
    """The block size for a blob of ``size`` bytes: ``wanted``, raised (in MiB steps) to fit in 50,000 blocks."""
    return part_size_for(size, wanted, MAX_BLOCKS)


class BlobOutput(PartedOutput):
    """Shard ``blob`` being written (see the module docstring)."""

    how = "blocks"
    failures = FAILURES
    thread_name = "mmapckpt-az-put"

    def __init__(self, blob: Any, url: str, size: int | None, *, head: int, part_size: int, concurrency: int) -> None:
        super().__init__(url, size, start=head, part_size=block_size_for(size, part_size), concurrency=concurrency)
        self.blob, self.head = blob, head
        self._tag = uuid.uuid4().hex[:16]  # block ids of this upload only (another upload may stage the same name)
        self._ids: list[str] = []  # blocks after the head's, in order

    def _block_id(self, n: int) -> str:
        return base64.b64encode(f"{self._tag}-{n:06d}".encode()).decode()

    def _full(self, buf: bytearray) -> None:
        self._stage(buf)

    def _stage(self, data: bytearray | bytes, block_id: str | None = None) -> None:
        if block_id is None:
            block_id = self._block_id(len(self._ids) + 1)
            self._ids.append(block_id)
        self._submit(self._put_block, block_id, data)

    def _put_block(self, block_id: str, data: bytearray | bytes) -> None:
        try:
            self.blob.stage_block(block_id, data, length=len(data))
        except Exception as e:
            raise self._error(e, "staging a block") from e

    def finish(self, head: bytes) -> None:
        head = self._padded_head(head, self.head)
        self._pad_to_size()
        try:
            if not self._ids:  # smaller than one block: one Put Blob
                self.blob.upload_blob(head + bytes(self._buf), overwrite=True, max_concurrency=1)
                return
            if self._buf:
                self._stage(self._buf)
                self._buf = bytearray()
            first = [self._block_id(0)] if head else []
            if head:
                self._stage(head, first[0])
            self._results()
            self.blob.commit_block_list(first + self._ids)
        except CheckpointError:
            raise
        except Exception as e:
            raise self._error(e, "committing the blocks") from e
        finally:
            self._close_threads()

    def abort(self) -> None:
        """Staged blocks stay uncommitted (invisible; Azure discards them): nothing to remove."""
        self._close_threads()
        self._buf = bytearray()
