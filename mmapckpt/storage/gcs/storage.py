"""A checkpoint under a Google Cloud Storage prefix: ``gs://BUCKET/PREFIX``.

The objects are the local checkpoint's files, byte for byte, under ``PREFIX/``, as on S3
(``storage/s3/storage.py``, whose shape this follows):

- Reading: :class:`GCSFile` is one object generation (size and generation from its metadata); every
  byte is read with ranged GETs of that generation into the caller's buffers (``reads.py``). No
  mapping (``can_map`` False).
- Writing: shards are parts composed into the object once the head is known (``uploads.py``), under
  names no commit uses (``storage/commits.py`` ``shard_name``); the commit is one upload of
  ``.metadata``, atomic (readers see the old generation or the new one); what no commit references is
  removed after it.
- Locking: a lock object taken and renewed with generation preconditions (``lock.py``). While it is
  held, a commit checks it first and is then conditional on the generation of ``.metadata`` the save
  saw when it took the lock (``ifGenerationMatch``; 0 where there was none).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from ...errors import CheckpointNotFoundError, CheckpointWriteError, IncompleteCheckpointError
from ..holders import job_identity
from ..leased_lock import LeasedLock
from ..object_store import ObjectFile, ObjectStorage, TransferStats
from .failures import FAILURES, is_missing, storage_error
from .lock import LOCK_NAME, GenerationLock
from .options import GCSOptions, client_for, parse_url
from .reads import ObjectReads
from .uploads import ComposedOutput

__all__ = ["GCSStorage", "GCSFile"]


class GCSFile(ObjectFile):
    """One object, open for ranged reads of the generation it had when opened."""

    def __init__(self, storage: GCSStorage, name: str, blob: Any) -> None:
        self.path = storage.full(name)
        self.size = int(blob.size)
        self.ident = (blob.generation, blob.updated)
        self._reads = ObjectReads(storage.bucket, storage.key(name), blob.generation, self.size, self.path,
                                  storage.opts.part_size, storage.opts.concurrency, storage.stats.add,
                                  retry=storage.retry, timeout=storage.opts.timeout,
                                  retries=storage.opts.retries)


class GCSStorage(ObjectStorage):
    """The checkpoint at ``gs://BUCKET/PREFIX`` (see the module docstring)."""

    failures = FAILURES

    def __init__(self, url: str, options: Mapping[str, Any] | None = None) -> None:
        from google.api_core.retry import Retry
        self.location = url.rstrip("/")
        self.bucket_name, self.prefix = parse_url(url)
        self.opts = GCSOptions.of(options)
        self.client = client_for(self.opts, self.location)
        self.bucket = self.client.bucket(self.bucket_name)
        # google's retries are bounded by time, not count: ``retries`` more request timeouts at most
        self.retry = Retry(initial=0.1, maximum=5.0, timeout=self.opts.timeout * self.opts.retries or 0.001)
        self.stats = TransferStats()
        self._fresh()

    def _blob(self, name: str) -> Any:
        blob = self.bucket.blob(self.key(name))
        try:
            blob.reload(timeout=self.opts.timeout, retry=self.retry)
        except Exception as e:
            if is_missing(e) and self._bucket_exists():
                return None
            raise storage_error(e, self.full(name), what="looking for the object") from e
        return blob

    def _bucket_exists(self) -> bool:
        try:
            return bool(self.bucket.exists(timeout=self.opts.timeout, retry=self.retry))
        except Exception as e:
            raise storage_error(e, self.location, what="looking for the bucket") from e

    def exists(self, name: str) -> bool:
        try:
            return self._blob(name) is not None
        except CheckpointNotFoundError:
            return False

    def _any_object(self) -> bool:
        return any(True for _ in self.client.list_blobs(self.bucket_name, prefix=self._dir(), max_results=1,
                                                          retry=self.retry))

    def open_file(self, name: str) -> GCSFile:
        blob = self._blob(name)
        if blob is None:
            raise IncompleteCheckpointError("no such object", path=self.full(name))
        return GCSFile(self, name, blob)

    def _names(self) -> list[str]:
        d = self._dir()
        return [b.name[len(d):] for b in self.client.list_blobs(self.bucket_name, prefix=d, delimiter="/",
                                                                retry=self.retry)]

    def _below(self) -> Iterator[tuple[str, int]]:
        d = self._dir()
        for b in self.client.list_blobs(self.bucket_name, prefix=d, retry=self.retry):
            yield b.name[len(d):], int(b.size or 0)

    def prepare(self) -> None:
        if not self._bucket_exists():
            raise CheckpointWriteError(f"no such bucket {self.bucket_name!r} (create it first, or check the URL)",
                                       path=self.location)

    def create_file(self, name: str, size: int | None, *, head: int, direct: bool, sync: bool) -> ComposedOutput:
        return ComposedOutput(self.bucket, self.key(name), self.full(name), size, head=head,
                              part_size=self.opts.upload_part_size, concurrency=self.opts.upload_concurrency,
                              retry=self.retry)

    def _put(self, name: str, data: bytes, seen: Any, *, fenced: bool) -> Any:
        blob = self.bucket.blob(self.key(name))
        if not fenced:
            blob.upload_from_string(data, retry=self.retry)
        else:
            blob.upload_from_string(data, if_generation_match=seen or 0, retry=self.retry)
        return int(blob.generation or 0)

    def _delete(self, names: list[str]) -> None:
        for n in names:
            try:
                self.bucket.blob(self.key(n)).delete()
            except Exception:
                pass

    def _new_lock(self) -> LeasedLock:
        return GenerationLock(self.bucket, self.key(LOCK_NAME), self.full(LOCK_NAME), lease=self.opts.lock_lease,
                              wait=self.opts.lock_wait, job=job_identity(self.opts.lock_job),
                              require_preconditions=self.opts.require_preconditions)

    def _current_versions(self) -> dict[str, int]:
        d = self._dir()
        return {b.name[len(d):]: int(b.generation) for b in self.client.list_blobs(self.bucket_name, prefix=d,
                                                                                   delimiter="/")}
