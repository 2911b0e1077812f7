"""Ranged GETs of one object straight into the callers' buffers, many in flight.

A batch of reads (``(offset, buffer)`` pairs: target tensors, staging buffers, broadcast
buffers) becomes requests of at most ``part_size`` bytes: a long read is split, short reads
of neighbouring ranges are joined into one request whose body is scattered into their
buffers (gaps of at most ``_GAP`` bytes are read into a scratch buffer and dropped).
Requests run on a shared pool of ``concurrency`` threads. Each response body is read with
``readinto`` into the buffers themselves: no temporary file, no copy of the object, memory
beyond the callers' buffers bounded by one scratch gap per request.

Every GET is conditional on the ETag the object had when it was opened (``If-Match``): an
object replaced meanwhile answers 412 and the read fails, never mixing two versions. A body
that breaks off is read again from the first byte not yet received, at most ``retries``
times with exponential backoff (botocore retries the request itself; a broken stream is ours).
"""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

from ...errors import CheckpointError, IncompleteCheckpointError, TruncatedFileError
from .failures import TRANSIENT_STREAM_ERRORS, is_missing, is_precondition_failed, storage_error
from .options import S3Options

__all__ = ["Fetch", "ObjectReads", "plan_requests"]

#: Neighbouring reads at most this far apart are joined into one request (the gap is read and dropped).
_GAP = 256 << 10
#: A request's body is read in pieces of at most this many bytes (so a retry resumes close to where it broke).
_STEP = 4 << 20

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


_pools: dict[int, ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()


def _pool(threads: int) -> ThreadPoolExecutor:
    """The shared pool of ``threads`` request threads (its tasks never wait on one another)."""
    with _pools_lock:
        pool = _pools.get(threads)
        if pool is None:
            pool = _pools[threads] = ThreadPoolExecutor(threads, thread_name_prefix="mmapckpt-s3")
        return pool


class ObjectReads:
    """Ranged reads of one object version (``etag``) of ``size`` bytes; ``on_fetch(bytes, requests)`` hears of
    every GET and every byte received (gaps and retried bytes included: what the store sent)."""

    def __init__(self, client: Any, bucket: str, key: str, etag: str | None, size: int, url: str,
                 opts: S3Options, on_fetch: Callable[[int, int], None] | None = None) -> None:
        self.client, self.bucket, self.key, self.etag, self.size, self.url = client, bucket, key, etag, size, url
        self.opts, self.on_fetch = opts, on_fetch

    def read(self, fetches: list[Fetch], entry: str | None = None) -> None:
        """Fill every buffer of ``fetches`` with the object's bytes at its offset (requests in parallel)."""
        for offset, buf in fetches:
            n = memoryview(buf).nbytes
            if offset < 0 or offset + n > self.size:
                raise TruncatedFileError(f"data [{offset}, +{n}) runs past the end of the {self.size}-byte object",
                                         path=self.url, entry=entry)
        requests = plan_requests([(o, b) for o, b in fetches if memoryview(b).nbytes], self.opts.part_size)
        if len(requests) <= 1:
            for start, segments in requests:
                self._get(start, segments, entry)
            return
        pool = _pool(self.opts.concurrency)
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
        """One request: the bytes from ``start`` scattered into ``segments``, resumed where a body breaks off."""
        total = sum(s if isinstance(s, int) else len(s) for s in segments)
        progress, attempt = [0], 0  # bytes of the request received, across attempts
        while progress[0] < total:
            try:
                self._stream(start, total, segments, progress, entry)
            except CheckpointError:  # the request itself failed (botocore has retried it): not a broken body
                raise
            except TRANSIENT_STREAM_ERRORS as e:
                attempt += 1
                if attempt > self.opts.retries:
                    raise storage_error(e, self.url, what=f"reading bytes [{start}, +{total})", entry=entry) from e
                time.sleep(min(5.0, 0.05 * 2 ** attempt) * (0.5 + random.random()))

    def _stream(self, start: int, total: int, segments: list[Any], progress: list[int], entry: str | None) -> None:
        """GET the request's bytes from ``start + progress[0]`` on into its segments, advancing ``progress``
        as they arrive (a body that breaks off raises a transient stream error, the progress kept)."""
        pos, n = start + progress[0], total - progress[0]
        kwargs = {"IfMatch": self.etag} if self.etag else {}
        try:
            resp = self.client.get_object(Bucket=self.bucket, Key=self.key, Range=f"bytes={pos}-{pos + n - 1}",
                                          **kwargs)
        except CheckpointError:
            raise
        except Exception as e:
            if is_precondition_failed(e):
                raise IncompleteCheckpointError("the object changed while it was being read (a later save "
                                                "replaced it): load again", path=self.url, entry=entry) from None
            if is_missing(e):
                raise IncompleteCheckpointError("the object was removed while it was being read (a later save "
                                                "replaced the checkpoint): load again", path=self.url,
                                                entry=entry) from None
            raise storage_error(e, self.url, what="reading", entry=entry) from e
        if self.on_fetch is not None:
            self.on_fetch(0, 1)
        body = resp["Body"]
        length = resp.get("ContentLength")
        if length is not None and length != n:
            body.close()
            raise TruncatedFileError(f"asked for {n} bytes at {pos}, the store sent {length}", path=self.url,
                                     entry=entry)
        stream, release = _direct_stream(body)
        try:
            for mv in _segments_from(segments, progress[0]):
                _read_exactly(stream, mv, progress, self.on_fetch)
        finally:
            if progress[0] < total:
                body.close()
            else:
                release()


def _segments_from(segments: list[Any], skip: int):  # type: ignore[no-untyped-def]
    """The writable memoryviews of ``segments`` past their first ``skip`` bytes (gaps as scratch buffers)."""
    for s in segments:
        n = s if isinstance(s, int) else len(s)
        if skip >= n:
            skip -= n
            continue
        if isinstance(s, int):
            yield memoryview(bytearray(n - skip))
        else:
            yield s[skip:]
        skip = 0


def _direct_stream(body: Any) -> tuple[Any, Callable[[], None]]:
    """``(what to readinto from, what returns the connection to the pool once the body is read)``.

    urllib3's response ``readinto`` reads into a new bytes object and copies; the ``http.client``
    response beneath it reads from the socket into the buffer itself. That one is used where the
    body is not content-encoded (objects are stored as they are); botocore's ``StreamingBody``
    otherwise (one copy more).
    """
    raw = getattr(body, "_raw_stream", None)
    fp = getattr(raw, "_fp", None)
    encoding = (getattr(raw, "headers", None) or {}).get("content-encoding", "identity")
    if fp is None or not hasattr(fp, "readinto") or encoding.lower() not in ("", "identity"):
        return _BodyStream(body), body.close

    def release() -> None:
        raw.drain_conn()
        raw.release_conn()
    return fp, release


class _BodyStream:
    """``readinto`` over a body without one (a copy through bytes)."""

    def __init__(self, body: Any) -> None:
        self.body = body

    def readinto(self, mv: memoryview) -> int:
        data = self.body.read(len(mv))
        mv[:len(data)] = data
        return len(data)


def _read_exactly(raw: Any, mv: memoryview, progress: list[int],
                  on_fetch: Callable[[int, int], None] | None) -> None:
    """Fill ``mv`` from ``raw``, adding what arrives to ``progress[0]``; a body that ends early raises
    a transient stream error."""
    pos, n = 0, len(mv)
    try:
        while pos < n:
            got = raw.readinto(mv[pos:pos + _STEP])
            if not got:
                raise ConnectionError(f"the response body ended after {pos} of {n} bytes")
            pos += got
            progress[0] += got
    finally:
        if on_fetch is not None and pos:
            on_fetch(pos, 0)
