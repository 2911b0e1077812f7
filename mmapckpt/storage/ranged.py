"""Ranged reads of one object version into the callers' buffers, for every object store.

A batch of reads (``(offset, buffer)`` pairs: target tensors, staging buffers, broadcast buffers) becomes
requests of at most ``part_size`` bytes (:func:`plan_requests`; a batch of more than ``concurrency`` parts gets
longer requests, one per thread, up to ``_MAX_PARTS`` parts: :meth:`RangedReads.request_size`): a long read is split, short reads of
neighbouring ranges are joined into one request whose body is scattered into their buffers (gaps of at
most ``_GAP`` bytes are read and dropped). The requests run on a shared pool of ``concurrency`` threads per
medium. A medium supplies :meth:`RangedReads._fetch`, which writes one request's bytes into a :class:`Into`
over its buffers as they arrive (Azure Blob's ``readinto``, GCS's ``download_to_file``: the one copy those
clients allow), or its own :meth:`RangedReads._get` (S3's, which reads the body into the buffers themselves
and resumes a body that breaks off).
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

from ..errors import IncompleteCheckpointError, TruncatedFileError

__all__ = ["Into", "RangedReads", "Fetch", "plan_requests", "replaced_while_read"]

#: Neighbouring reads at most this far apart are joined into one request (the gap is read and dropped).
_GAP = 256 << 10

#: A request of a large batch is at most this many parts long (its share of the threads, where that is more than
#: one part): fewer, longer GETs cost the client and the store less per byte (radosgw, 1 GB, 8 threads: 16 MiB
#: parts 0.81 of the best, 32 MiB 0.87, 64 MiB 1.0), while a request stays short enough to retry.
_MAX_PARTS = 4

#: One read of a batch: ``(offset, buffer)``; a buffer is any writable bytes-like object.
Fetch = tuple[int, Any]
#: One request: its first byte and its segments, each a buffer to fill or the length of a gap to drop.
Request = tuple[int, list[Any]]


def plan_requests(fetches: list[Fetch], part_size: int, gap: int = _GAP) -> list[Request]:
    """The requests of a batch: reads in offset order, long ones split at ``part_size``, neighbours
    (no more than ``gap`` bytes apart, together at most ``part_size``) joined. Overlapping reads are
    each requested on their own."""
    pieces: list[tuple[int, memoryview]] = []
    for offset, buf in fetches:
        mv = memoryview(buf).cast("B")
        for start in range(0, len(mv), part_size):
            pieces.append((offset + start, mv[start:start + part_size]))
    pieces.sort(key=lambda p: p[0])
    out: list[Request] = []
    end = -1
    for offset, mv in pieces:
        if out and end <= offset <= end + gap and offset + len(mv) - out[-1][0] <= part_size:
            if offset > end:
                out[-1][1].append(offset - end)
            out[-1][1].append(mv)
        else:
            out.append((offset, [mv]))
        end = offset + len(mv)
    return out


def replaced_while_read(noun: str, url: str, entry: str | None, how: str = "changed") -> IncompleteCheckpointError:
    """The error of a read whose object version is gone (``how``: "changed", "removed", "replaced or removed")."""
    if how == "changed":
        return IncompleteCheckpointError(f"the {noun} changed while it was being read (a later save replaced it): "
                                         "load again", path=url, entry=entry)
    return IncompleteCheckpointError(f"the {noun} was {how} while it was being read (a later save replaced the "
                                     "checkpoint): load again", path=url, entry=entry)

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


class RangedReads:
    """Ranged reads of one object version of ``size`` bytes; ``on_fetch(bytes, requests)`` hears of each GET."""

    pool_name = "ranged"

    def __init__(self, size: int, url: str, part_size: int, concurrency: int,
                 on_fetch: Callable[[int, int], None] | None = None) -> None:
        self.size, self.url, self.part_size, self.concurrency, self.on_fetch = size, url, part_size, concurrency, on_fetch

    def request_size(self, total: int) -> int:
        """The longest request of a batch of ``total`` bytes: ``part_size``, or, for a batch of more than
        ``concurrency`` such parts, its share of the threads (one request each), at most ``_MAX_PARTS`` parts."""
        return min(max(self.part_size, -(-total // self.concurrency)), _MAX_PARTS * self.part_size)

    def _fetch(self, start: int, length: int, into: Into, entry: str | None) -> None:
        """GET bytes ``[start, start + length)`` of the version opened into ``into``; a CheckpointError on failure."""
        raise NotImplementedError

    def read(self, fetches: list[Fetch], entry: str | None = None) -> None:
        """Fill every buffer of ``fetches`` with the object's bytes at its offset (requests in parallel)."""
        for offset, buf in fetches:
            n = memoryview(buf).nbytes
            if offset < 0 or offset + n > self.size:
                raise TruncatedFileError(f"data [{offset}, +{n}) runs past the end of the {self.size}-byte object",
                                         path=self.url, entry=entry)
        wanted = [(o, b) for o, b in fetches if memoryview(b).nbytes]
        requests = plan_requests(wanted, self.request_size(sum(memoryview(b).nbytes for _, b in wanted)))
        if len(requests) <= 1:
            for start, segments in requests:
                self._get(start, segments, entry)
            return
        pool = _pool(self.pool_name, self.concurrency)
        futures: list[Future[None]] = [pool.submit(self._get, s, segs, entry) for s, segs in requests]
        error: BaseException | None = None
        for fut in futures:
            if error is not None:
                fut.cancel()
                continue
            try:
                fut.result()
            except BaseException as e:  # the first failure; the rest are cancelled or awaited
                error = e
        if error is not None:
            for fut in futures:
                if not fut.cancelled():
                    try:
                        fut.result()
                    except BaseException:
                        pass
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
