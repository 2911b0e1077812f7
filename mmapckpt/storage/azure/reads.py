"""Ranged GETs of one blob version straight into the callers' buffers, many in flight.

A batch of ``(offset, buffer)`` reads is planned as on S3 (``s3/reads.py`` ``plan_requests``: long
reads split at ``part_size``, neighbours joined), and the requests run on a shared pool of
``concurrency`` threads. Each response is written into the request's buffers as it arrives
(``StorageStreamDownloader.readinto`` into a writer over them: the one copy azure-storage-blob
allows, from its response chunks; no temporary object of the blob's size). Every GET carries
``If-Match`` with the ETag the blob had when opened: a blob replaced meanwhile fails the read
(412), never mixing two versions.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from ...errors import IncompleteCheckpointError, TruncatedFileError
from ..s3.reads import Fetch, plan_requests
from .failures import is_missing, status, storage_error

__all__ = ["BlobReads"]

_pools: dict[int, ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()


def _pool(threads: int) -> ThreadPoolExecutor:
    with _pools_lock:
        pool = _pools.get(threads)
        if pool is None:
            pool = _pools[threads] = ThreadPoolExecutor(threads, thread_name_prefix="mmapckpt-az")
        return pool


class _Into:
    """A write-only file over a request's segments (buffers, and gaps given as lengths that are dropped)."""

    def __init__(self, segments: list[Any]) -> None:
        self.segments, self.i, self.pos, self.received = segments, 0, 0, 0

    def write(self, data: Any) -> int:
        mv = memoryview(data).cast("B")
        n = len(mv)
        while len(mv):
            if self.i >= len(self.segments):
                raise TruncatedFileError(f"the service sent {len(mv)} bytes more than asked for")
            seg = self.segments[self.i]
            room = (seg if isinstance(seg, int) else len(seg)) - self.pos
            take = min(room, len(mv))
            if not isinstance(seg, int):
                seg[self.pos:self.pos + take] = mv[:take]
            mv, self.pos = mv[take:], self.pos + take
            if self.pos == (seg if isinstance(seg, int) else len(seg)):
                self.i, self.pos = self.i + 1, 0
        self.received += n
        return n

    def writable(self) -> bool:
        return True


class BlobReads:
    """Ranged reads of one blob version (``etag``) of ``size`` bytes; ``on_fetch(bytes, requests)`` hears of each."""

    def __init__(self, blob: Any, etag: str | None, size: int, url: str, part_size: int, concurrency: int,
                 on_fetch: Callable[[int, int], None] | None = None) -> None:
        self.blob, self.etag, self.size, self.url = blob, etag, size, url
        self.part_size, self.concurrency, self.on_fetch = part_size, concurrency, on_fetch

    def read(self, fetches: list[Fetch], entry: str | None = None) -> None:
        for offset, buf in fetches:
            n = memoryview(buf).nbytes
            if offset < 0 or offset + n > self.size:
                raise TruncatedFileError(f"data [{offset}, +{n}) runs past the end of the {self.size}-byte blob",
                                         path=self.url, entry=entry)
        requests = plan_requests([(o, b) for o, b in fetches if memoryview(b).nbytes], self.part_size)
        if len(requests) <= 1:
            for start, segments in requests:
                self._get(start, segments, entry)
            return
        futures = [_pool(self.concurrency).submit(self._get, s, segs, entry) for s, segs in requests]
        error: BaseException | None = None
        for fut in futures:
            try:
                fut.result()
            except BaseException as e:  # noqa: BLE001  the first failure is raised once all have ended
                error = error or e
        if error is not None:
            raise error

    def _get(self, start: int, segments: list[Any], entry: str | None) -> None:
        from azure.core import MatchConditions
        total = sum(s if isinstance(s, int) else len(s) for s in segments)
        kwargs: dict[str, Any] = {"etag": self.etag, "match_condition": MatchConditions.IfNotModified} if self.etag else {}
        into = _Into(segments)
        try:
            self.blob.download_blob(offset=start, length=total, max_concurrency=1, **kwargs).readinto(into)
        except TruncatedFileError as e:
            raise TruncatedFileError(e.message, path=self.url, entry=entry) from None
        except Exception as e:
            if status(e) == 412:
                raise IncompleteCheckpointError("the blob changed while it was being read (a later save replaced "
                                                "it): load again", path=self.url, entry=entry) from None
            if is_missing(e):
                raise IncompleteCheckpointError("the blob was removed while it was being read (a later save "
                                                "replaced the checkpoint): load again", path=self.url,
                                                entry=entry) from None
            raise storage_error(e, self.url, what="reading", entry=entry) from e
        finally:
            if self.on_fetch is not None:
                self.on_fetch(into.received, 1)
        if into.received != total:
            raise TruncatedFileError(f"asked for {total} bytes at {start}, the service sent {into.received}",
                                     path=self.url, entry=entry)
