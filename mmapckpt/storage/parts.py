"""A shard written to an object store in parts, whatever the store: the bookkeeping every upload shares.

The shard writer hands pieces at ascending offsets and the head (offset 0) last. Pieces are gathered
into parts of ``part_size`` bytes (raised in MiB steps where a shard would need more parts than the store
allows: :func:`part_size_for`), alignment padding written as zeros (as a local file's holes read), and each
full part is sent at once on a pool of ``concurrency`` threads, at most that many in flight, so memory stays
within a few parts whatever the shard's size. Where the head goes, how a part is sent and how the object is
put together are the store's (``s3/uploads.py`` multipart uploads, ``azure/uploads.py`` staged blocks,
``gcs/uploads.py`` composed parts).
"""

from __future__ import annotations

from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any, Callable

from ..errors import CheckpointError
from .base import FileOutput
from .failures import StoreFailures

__all__ = ["PartedOutput", "part_size_for"]

MiB = 1 << 20


def part_size_for(size: int | None, wanted: int, max_parts: int, minimum: int = 1) -> int:
    """The part size for an object of ``size`` bytes: ``wanted`` (at least ``minimum``), raised in MiB steps so that
    the object fits in ``max_parts`` parts, one of them the head's."""
    parts = max_parts - 1  # one is the head's
    if size is None or size <= wanted * parts:
        return max(wanted, minimum)
    return -(-size // parts // MiB) * MiB + MiB


class PartedOutput(FileOutput):
    """An object being written in parts (see the module docstring). A store's output sets ``failures`` and
    ``thread_name``, and gives :meth:`_full` (what to do with a part gathered full)."""

    failures: StoreFailures
    thread_name = "mmapckpt-put"

    def __init__(self, path: str, size: int | None, *, start: int, part_size: int, concurrency: int) -> None:
        self.path, self.size, self.part_size, self.concurrency = path, size, part_size, concurrency
        self._buf = bytearray()  # the part being gathered
        self._end = start  # the end of the last piece (the head's bytes, where kept apart, come last)
        self._sent: list[Future[Any]] = []
        self._threads: ThreadPoolExecutor | None = None

    # ------------------------------------------------------------------ the pieces
    def put(self, offset: int, data: Any) -> None:
        mv = memoryview(data).cast("B")
        if offset < self._end:
            raise ValueError(f"piece at {offset} before the end of the previous one ({self._end})")
        if offset > self._end:  # alignment padding: zeros, as a local file's holes read
            self._append(memoryview(bytes(offset - self._end)))
        self._append(mv)
        self._end = offset + len(mv)

    def _cap(self) -> int:
        """The size of the part being gathered."""
        return self.part_size

    def _append(self, mv: memoryview) -> None:
        while len(mv):
            cap = self._cap()
            room = cap - len(self._buf)
            self._buf += mv[:room]
            mv = mv[room:]
            if len(self._buf) == cap:
                buf, self._buf = self._buf, bytearray()
                self._full(buf)

    def _full(self, buf: bytearray) -> None:
        """A part gathered full: send it (or keep it)."""
        raise NotImplementedError

    def _pad_to_size(self) -> None:
        """Zeros up to the size announced (a shard whose last entries were not written to the end)."""
        if self.size is not None and self._end < self.size:
            self._append(memoryview(bytes(self.size - self._end)))
            self._end = self.size

    @staticmethod
    def _padded_head(head: bytes, room: int) -> bytes:
        """``head`` filling the ``room`` bytes kept for it."""
        if len(head) > room:
            raise ValueError(f"head of {len(head)} bytes is longer than the {room} bytes kept for it")
        return bytes(head) + bytes(room - len(head))

    # ------------------------------------------------------------------ sending
    def _submit(self, send: Callable[..., Any], *args: Any) -> None:
        """Run ``send(*args)`` on the pool once fewer than ``concurrency`` sends are in flight (raising the error
        of one that failed)."""
        if self._threads is None:
            self._threads = ThreadPoolExecutor(self.concurrency, thread_name_prefix=self.thread_name)
        while sum(not f.done() for f in self._sent) >= self.concurrency:
            for f in wait([f for f in self._sent if not f.done()], return_when=FIRST_COMPLETED).done:
                f.result()
        self._sent.append(self._threads.submit(send, *args))

    def _results(self) -> list[Any]:
        """Wait for every send; their results, in the order sent (the first error raised)."""
        return [f.result() for f in self._sent]

    def _close_threads(self) -> None:
        threads, self._threads = self._threads, None
        if threads is not None:
            threads.shutdown(wait=True, cancel_futures=True)

    def _error(self, e: BaseException, what: str) -> CheckpointError:
        if isinstance(e, CheckpointError):
            return e
        return self.failures.write_error(e, self.path, what=what)
