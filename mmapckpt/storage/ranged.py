"""Ranged reads of one object version into the callers' buffers, for every object store.

A batch of reads (``(offset, buffer)`` pairs: target tensors, staging buffers, broadcast buffers) becomes requests of
``part_size`` bytes (:func:`plan_requests`; a batch of more than ``concurrency`` parts gets longer requests,
one per thread, up to ``_MAX_PARTS`` parts: :meth:`RangedReads.request_size`): neighbouring reads are joined into
runs (gaps of at most ``_GAP`` bytes are read and dropped), each run cut into requests of that size whose bodies are
scattered into the buffers, a read split where a cut falls in it. The requests run on a shared pool of
``concurrency`` threads per medium.

A medium supplies :meth:`RangedReads._open`, one GET of a byte range of the version opened, answered by its
client's HTTP response (urllib3 beneath boto3, azure-core and google-auth's session alike). Every medium's body is
then read the same way, here: with ``readinto`` from the ``http.client`` response beneath urllib3's, straight into
the buffers themselves (no chunk objects, no copy), where the body is not content-encoded; and a body that breaks
off is asked for again from its first byte not yet received, at most ``retries`` times with backoff (the clients
retry a request that fails; a broken stream is ours).
"""

from __future__ import annotations

import http.client
import random
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable

from ..errors import CheckpointError, IncompleteCheckpointError, StorageUnavailableError, TruncatedFileError

if TYPE_CHECKING:
    from .failures import StoreFailures

__all__ = ["RangedReads", "Fetch", "plan_requests", "requested_bytes", "replaced_while_read",
           "TRANSIENT_STREAM_ERRORS"]

#: Neighbouring reads at most this far apart are joined into one request (the gap is read and dropped).
_GAP = 256 << 10

#: A request of a large batch is at most this many parts long (its share of the threads, where that is more than
#: one part): fewer, longer GETs cost the client and the store less per byte (radosgw, 1 GB, 8 threads: 16 MiB
#: parts 0.81 of the best, 32 MiB 0.87, 64 MiB 1.0), while a request stays short enough to retry.
_MAX_PARTS = 4

#: A request's body is read in pieces of at most this many bytes (so a retry resumes close to where it broke).
_STEP = 4 << 20

#: One read of a batch: ``(offset, buffer)``; a buffer is any writable bytes-like object.
Fetch = tuple[int, Any]
#: One request: its first byte and its segments, each a buffer to fill or the length of a gap to drop.
Request = tuple[int, list[Any]]


def plan_requests(fetches: list[Fetch], part_size: int, gap: int = _GAP) -> list[Request]:
    """The requests of a batch: the reads in offset order, neighbours (at most ``gap`` bytes apart) joined into runs,
    each run cut into requests of ``part_size`` bytes, the last one shorter; a read is split where a cut falls in it,
    and a gap where one falls in it is not asked for. Overlapping reads are each requested on their own.

    Cut at bytes, not at reads: joining only whole reads of at most ``part_size`` left requests part empty, one more
    GET (a round trip, and a charge on the clouds) for every few tensors: the bench's 512 MB transformer over 16
    threads, requests of 30 MiB, was 19 requests of 10-26 MiB where 16 carry it (a whole load 22 GETs, now 19).
    """
    out: list[Request] = []
    end, room = -1, 0  # the end of the last read placed; the bytes the last request can still take
    for offset, buf in sorted(fetches, key=lambda f: f[0]):
        mv = memoryview(buf).cast("B")
        n = len(mv)
        if not n:
            continue
        if out and end <= offset <= end + gap and offset - end < room:  # a neighbour: joins the last request
            if offset > end:
                out[-1][1].append(offset - end)
                room -= offset - end
        else:
            out.append((offset, []))
            room = part_size
        while True:
            take = mv[:room]
            out[-1][1].append(take)
            room -= len(take)
            mv = mv[len(take):]
            if not len(mv):
                break
            out.append((offset + n - len(mv), []))  # the request is full: the rest of the read starts the next one
            room = part_size
        end = offset + n
    return out


def requested_bytes(fetches: list[Fetch], gap: int = _GAP) -> int:
    """The bytes :func:`plan_requests` asks for: every read's, and the gaps it joins (so that a batch cut into one
    request per thread is not one more for the alignment padding between its tensors)."""
    total, end = 0, None  # the end of the reads so far
    for offset, buf in sorted(fetches, key=lambda f: f[0]):
        n = memoryview(buf).nbytes
        if n:
            total += n + (offset - end if end is not None and end < offset <= end + gap else 0)
            end = offset + n if end is None else max(end, offset + n)
    return total


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


def _stream_errors() -> tuple[type[BaseException], ...]:
    """Errors of a response body's stream that asking again from the bytes already read may cure."""
    out: list[type[BaseException]] = [ConnectionError, TimeoutError, http.client.IncompleteRead]
    try:
        import urllib3.exceptions as u
        out += [u.ProtocolError, u.ReadTimeoutError, u.IncompleteRead]
    except ImportError:  # no object store's client is installed: nothing streams
        pass
    return tuple(out)


#: A broken response body (the connection reset, closed early or timed out mid-body): read again from where it broke.
TRANSIENT_STREAM_ERRORS = _stream_errors()


class RangedReads:
    """Ranged reads of one object version of ``size`` bytes; ``on_fetch(bytes, requests)`` hears of every GET and
    every byte received (gaps and bytes received again after a break included: what the store sent); a broken body
    is asked for again at most ``retries`` times."""

    pool_name = "ranged"
    #: the store's rules (``storage/failures.py``): its ``storage_error`` says what a body broken past the retries
    #: means, naming the settings to check; None: a generic StorageUnavailableError
    failures: StoreFailures | None = None

    def __init__(self, size: int, url: str, part_size: int, concurrency: int,
                 on_fetch: Callable[[int, int], None] | None = None, *, retries: int = 5) -> None:
        self.size, self.url, self.part_size, self.concurrency, self.on_fetch = size, url, part_size, concurrency, on_fetch
        self.retries = retries

    def request_size(self, total: int) -> int:
        """The longest request of a batch of ``total`` bytes: ``part_size``, or, for a batch of more than
        ``concurrency`` such parts, its share of the threads (one request each), at most ``_MAX_PARTS`` parts."""
        return min(max(self.part_size, -(-total // self.concurrency)), _MAX_PARTS * self.part_size)

    def _open(self, start: int, length: int, entry: str | None) -> Any:
        """GET bytes ``[start, start + length)`` of the version opened: the client's urllib3 response, its body not
        yet read, after a successful status; a CheckpointError otherwise (a version gone: ``replaced_while_read``)."""
        raise NotImplementedError

    def read(self, fetches: list[Fetch], entry: str | None = None, request_bytes: int | None = None) -> None:
        """Fill every buffer of ``fetches`` with the object's bytes at its offset (requests in parallel, at most
        ``request_bytes`` long: :meth:`request_size` of the batch when None)."""
        for offset, buf in fetches:
            n = memoryview(buf).nbytes
            if offset < 0 or offset + n > self.size:
                raise TruncatedFileError(f"data [{offset}, +{n}) runs past the end of the {self.size}-byte object",
                                         path=self.url, entry=entry)
        wanted = [(o, b) for o, b in fetches if memoryview(b).nbytes]
        requests = plan_requests(wanted, request_bytes or self.request_size(requested_bytes(wanted)))
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
        """One request: the bytes from ``start`` scattered into ``segments``, asked for again from the first byte
        not received where a body breaks off."""
        total = sum(s if isinstance(s, int) else len(s) for s in segments)
        progress, attempt = [0], 0  # bytes of the request received, across attempts
        while progress[0] < total:
            try:
                self._stream(start, total, segments, progress, entry)
            except CheckpointError:  # the request itself failed (the client has retried it): not a broken body
                raise
            except TRANSIENT_STREAM_ERRORS as e:
                attempt += 1
                if attempt > self.retries:
                    what = f"reading bytes [{start}, +{total})"
                    if self.failures is not None:
                        raise self.failures.storage_error(e, self.url, what=what, entry=entry) from e
                    raise StorageUnavailableError(f"{what}: the object store is unreachable or stopped answering "
                                                  f"({type(e).__name__}: {e})", path=self.url, entry=entry) from e
                time.sleep(min(5.0, 0.05 * 2 ** attempt) * (0.5 + random.random()))

    def _stream(self, start: int, total: int, segments: list[Any], progress: list[int], entry: str | None) -> None:
        """GET the request's bytes from ``start + progress[0]`` on into its segments, advancing ``progress`` as they
        arrive (a body that breaks off raises a transient stream error, the progress kept)."""
        pos, n = start + progress[0], total - progress[0]
        raw = self._open(pos, n, entry)
        if self.on_fetch is not None:
            self.on_fetch(0, 1)
        length = _content_length(raw)
        if length is not None and length != n:
            raw.close()
            raise TruncatedFileError(f"asked for {n} bytes at {pos}, the store sent {length}", path=self.url,
                                     entry=entry)
        stream, release = _direct_stream(raw)
        try:
            for mv in _segments_from(segments, progress[0]):
                _read_exactly(stream, mv, progress, self.on_fetch)
        finally:
            if progress[0] < total:
                raw.close()
            else:
                release()


def _content_length(raw: Any) -> int | None:
    value = (getattr(raw, "headers", None) or {}).get("content-length")
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


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


def _direct_stream(raw: Any) -> tuple[Any, Callable[[], None]]:
    """``(what to readinto from, what returns the connection to the pool once the body is read)`` for urllib3's
    response ``raw``.

    urllib3's ``readinto`` reads into a new bytes object and copies; the ``http.client`` response beneath it reads
    from the socket into the buffer itself. That one is used where the body is not content-encoded (objects are
    stored as they are); urllib3's ``read`` otherwise (one copy more).
    """
    fp = getattr(raw, "_fp", None)
    encoding = (getattr(raw, "headers", None) or {}).get("content-encoding", "identity")
    release = getattr(raw, "release_conn", None)
    if fp is None or not hasattr(fp, "readinto") or encoding.lower() not in ("", "identity") or release is None:
        return _ReadStream(raw), raw.close

    def give_back() -> None:
        raw.drain_conn()
        release()
    return fp, give_back


class _ReadStream:
    """``readinto`` over a response without a direct one (a copy through bytes)."""

    def __init__(self, raw: Any) -> None:
        self.raw = raw

    def readinto(self, mv: memoryview) -> int:
        data = self.raw.read(len(mv))
        mv[:len(data)] = data
        return len(data)


def _read_exactly(raw: Any, mv: memoryview, progress: list[int], on_fetch: Callable[[int, int], None] | None) -> None:
    """Fill ``mv`` from ``raw``, adding what arrives to ``progress[0]``; a body that ends early raises a transient
    stream error."""
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
