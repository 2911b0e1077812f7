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
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any

from ...errors import CheckpointError
from ..base import FileOutput
from .failures import write_error
from .options import MAX_BLOCKS

__all__ = ["BlobOutput", "block_size_for"]


def block_size_for(size: int | None, wanted: int) -> int:
    """The block size for a blob of ``size`` bytes: ``wanted``, raised (in MiB steps) to fit in 50,000 blocks."""
    blocks = MAX_BLOCKS - 1  # one is the head's
    if size is None or size <= wanted * blocks:
        return wanted
    mib = 1 << 20
    return -(-size // blocks // mib) * mib + mib


class BlobOutput(FileOutput):
    """Shard ``blob`` being written (see the module docstring)."""

    how = "blocks"

    def __init__(self, blob: Any, url: str, size: int | None, *, head: int, part_size: int, concurrency: int) -> None:
        self.blob, self.path, self.size, self.head = blob, url, size, head
        self.part_size = block_size_for(size, part_size)
        self.concurrency = concurrency
        self._tag = uuid.uuid4().hex[:16]  # block ids of this upload only (another upload may stage the same name)
        self._buf = bytearray()
        self._end = head  # the end of the last piece; the head's bytes come last
        self._ids: list[str] = []  # blocks after the head's, in order
        self._staged: list[Future[None]] = []
        self._threads: ThreadPoolExecutor | None = None

    def _block_id(self, n: int) -> str:
        return base64.b64encode(f"{self._tag}-{n:06d}".encode()).decode()

    def put(self, offset: int, data: Any) -> None:
        mv = memoryview(data).cast("B")
        if offset < self._end:
            raise ValueError(f"piece at {offset} before the end of the previous one (or the head) ({self._end})")
        if offset > self._end:  # alignment padding: zeros, as a local file's holes read
            self._append(memoryview(bytes(offset - self._end)))
        self._append(mv)
        self._end = offset + len(mv)

    def _append(self, mv: memoryview) -> None:
        while len(mv):
            room = self.part_size - len(self._buf)
            self._buf += mv[:room]
            mv = mv[room:]
            if len(self._buf) == self.part_size:
                self._stage(self._buf)
                self._buf = bytearray()

    def _stage(self, data: bytearray | bytes, block_id: str | None = None) -> None:
        if block_id is None:
            block_id = self._block_id(len(self._ids) + 1)
            self._ids.append(block_id)
        if self._threads is None:
            self._threads = ThreadPoolExecutor(self.concurrency, thread_name_prefix="mmapckpt-az-put")
        while sum(not f.done() for f in self._staged) >= self.concurrency:
            for f in wait([f for f in self._staged if not f.done()], return_when=FIRST_COMPLETED).done:
                f.result()
        self._staged.append(self._threads.submit(self._put_block, block_id, data))

    def _put_block(self, block_id: str, data: bytearray | bytes) -> None:
        try:
            self.blob.stage_block(block_id, data, length=len(data))
        except Exception as e:
            raise self._error(e, "staging a block") from e

    def finish(self, head: bytes) -> None:
        if len(head) > self.head:
            raise ValueError(f"head of {len(head)} bytes is longer than the {self.head} bytes kept for it")
        head = bytes(head) + bytes(self.head - len(head))
        if self.size is not None and self._end < self.size:
            self._append(memoryview(bytes(self.size - self._end)))
            self._end = self.size
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
            for f in self._staged:
                f.result()
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

    def _close_threads(self) -> None:
        threads, self._threads = self._threads, None
        if threads is not None:
            threads.shutdown(wait=True, cancel_futures=True)

    def _error(self, e: BaseException, what: str) -> CheckpointError:
        if isinstance(e, CheckpointError):
            return e
        return write_error(e, self.path, what=what)
