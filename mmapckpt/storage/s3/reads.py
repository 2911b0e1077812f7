"""Ranged GETs of one object straight into the callers' buffers, many in flight.

A batch of reads (``(offset, buffer)`` pairs: target tensors, staging buffers, broadcast
buffers) becomes requests of at most ``part_size`` bytes, planned and run on a shared pool of
``concurrency`` threads as on every store (``storage/ranged.py``): a long read is split, short
reads of neighbouring ranges are joined into one request whose body is scattered into their
buffers (gaps read into a scratch buffer and dropped). Each response body is read with
``readinto`` into the buffers themselves: no temporary file, no copy of the object, memory
beyond the callers' buffers bounded by one scratch gap per request.

Every GET is conditional on the ETag the object had when it was opened (``If-Match``): an
object replaced meanwhile answers 412 and the read fails, never mixing two versions. A body
that breaks off is read again from the first byte not yet received, at most ``retries``
times with exponential backoff (botocore retries the request itself; a broken stream is ours).
"""

from __future__ import annotations

import random
import time
from typing import Any, Callable

from ...errors import CheckpointError, TruncatedFileError
from ..ranged import Fetch, RangedReads, plan_requests, replaced_while_read
from .failures import TRANSIENT_STREAM_ERRORS, is_missing, is_precondition_failed, storage_error
from .options import S3Options

__all__ = ["Fetch", "ObjectReads", "plan_requests"]

#: A request's body is read in pieces of at most this many bytes (so a retry resumes close to where it broke).
_STEP = 4 << 20


class ObjectReads(RangedReads):
    """Ranged reads of one object version (``etag``) of ``size`` bytes (planned and run by ``RangedReads.read``);
    ``on_fetch(bytes, requests)`` hears of every GET and every byte received (gaps and retried bytes included: what
    the store sent)."""

    pool_name = "s3"

    def __init__(self, client: Any, bucket: str, key: str, etag: str | None, size: int, url: str,
                 opts: S3Options, on_fetch: Callable[[int, int], None] | None = None) -> None:
        super().__init__(size, url, opts.part_size, opts.concurrency, on_fetch)
        self.client, self.bucket, self.key, self.etag, self.opts = client, bucket, key, etag, opts

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
                raise replaced_while_read("object", self.url, entry) from None
            if is_missing(e):
                raise replaced_while_read("object", self.url, entry, "removed") from None
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
