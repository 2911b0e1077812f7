"""Ranged reads of one object version into the callers' buffers, for media whose clients write responses into a
file-like object (Azure Blob's ``readinto``, GCS's ``download_to_file``).

A batch of ``(offset, buffer)`` reads is planned as on S3 (``s3/reads.py`` ``plan_requests``: long reads
split at ``part_size``, neighbours joined with their gaps dropped), and the requests run on a shared pool
of ``concurrency`` threads per medium. A medium supplies :meth:`RangedReads._fetch`, which writes one
request's bytes into a :class:`Into` over its buffers as they arrive: the one copy those clients allow
(from their response chunks into the target), never a temporary object of the file's size.
"""

from __future__ import annotations

import abc
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from ..errors import TruncatedFileError
from .s3.reads import Fetch, plan_requests

__all__ = ["Into", "RangedReads"]

_pools: dict[tuple[str, int], ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()


def _pool(name: str, threads: int) -> ThreadPoolExecutor:
    with _pools_lock:
        pool = _pools.get((name, threads))
        if pool is None:
            pool = _pools[(name, threads)] = ThreadPoolExecutor(threads, thread_name_prefix=f"mmapckpt-{name}")
        return pool


class Into:
    """A write-only file over a request's segments (buffers, and gaps given as lengths that are dropped)."""

    def __init__(self, segments: list[Any]) -> None:
        self.segments, self.i, self.pos, self.received = segments, 0, 0, 0

    def write(self, data: Any) -> int:
        mv = memoryview(data).cast("B")
        n = len(mv)
        while len(mv):
            if self.i >= len(self.segments):
                raise TruncatedFileError(f"the store sent {len(mv)} bytes more than asked for")
            seg = self.segments[self.i]
            size = seg if isinstance(seg, int) else len(seg)
            take = min(size - self.pos, len(mv))
            if not isinstance(seg, int):
                seg[self.pos:self.pos + take] = mv[:take]
            mv, self.pos = mv[take:], self.pos + take
            if self.pos == size:
                self.i, self.pos = self.i + 1, 0
        self.received += n
        return n

    def writable(self) -> bool:
        return True

    def flush(self) -> None:
        pass


class RangedReads(abc.ABC):
    """Ranged reads of one object version of ``size`` bytes; ``on_fetch(bytes, requests)`` hears of each GET."""

    pool_name = "ranged"

    def __init__(self, size: int, url: str, part_size: int, concurrency: int,
                 on_fetch: Callable[[int, int], None] | None = None) -> None:
        self.size, self.url, self.part_size, self.concurrency, self.on_fetch = size, url, part_size, concurrency, on_fetch

    @abc.abstractmethod
    def _fetch(self, start: int, length: int, into: Into, entry: str | None) -> None:
        """GET bytes ``[start, start + length)`` of the version opened into ``into``; a CheckpointError on failure."""

    def read(self, fetches: list[Fetch], entry: str | None = None) -> None:
        """Fill every buffer of ``fetches`` with the object's bytes at its offset (requests in parallel)."""
        for offset, buf in fetches:
            n = memoryview(buf).nbytes
            if offset < 0 or offset + n > self.size:
                raise TruncatedFileError(f"data [{offset}, +{n}) runs past the end of the {self.size}-byte object",
                                         path=self.url, entry=entry)
        requests = plan_requests([(o, b) for o, b in fetches if memoryview(b).nbytes], self.part_size)
        if len(requests) <= 1:
            for start, segments in requests:
                self._get(start, segments, entry)
            return
        futures = [_pool(self.pool_name, self.concurrency).submit(self._get, s, segs, entry) for s, segs in requests]
        error: BaseException | None = None
        for fut in futures:
            try:
                fut.result()
            except BaseException as e:  # the first failure is raised once all have ended
                error = error or e
        if error is not None:
            raise error

    def _get(self, start: int, segments: list[Any], entry: str | None) -> None:
        total = sum(s if isinstance(s, int) else len(s) for s in segments)
        into = Into(segments)
        try:
            self._fetch(start, total, into, entry)
        except TruncatedFileError as e:
            raise TruncatedFileError(e.message, path=self.url, entry=entry) from None
        finally:
            if self.on_fetch is not None:
                self.on_fetch(into.received, 1)
        if into.received != total:
            raise TruncatedFileError(f"asked for {total} bytes at {start}, the store sent {into.received}",
                                     path=self.url, entry=entry)
