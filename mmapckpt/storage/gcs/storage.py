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

import threading
from collections.abc import Iterable, Mapping
from typing import Any

from ...errors import CheckpointError, CheckpointNotFoundError, CheckpointWriteError, IncompleteCheckpointError, \
    UnsafePathError
from ..base import CheckpointStorage, Lock, StoredFile
from ..holders import job_identity
from .failures import is_missing, is_precondition_failed, storage_error, write_error
from .lock import LOCK_NAME, GenerationLock
from .options import GCSOptions, client_for, parse_url
from .reads import ObjectReads
from .uploads import ComposedOutput

__all__ = ["GCSStorage", "GCSFile"]

_HEAD = 64 << 10


class _Stats:
    """Bytes received and GET requests of a storage's reads (thread-safe), as ``S3Storage.stats``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.bytes = 0
        self.requests = 0

    def add(self, nbytes: int, requests: int) -> None:
        with self._lock:
            self.bytes += nbytes
            self.requests += requests


class GCSFile(StoredFile):
    """One object, open for ranged reads of the generation it had when opened."""

    def __init__(self, storage: GCSStorage, name: str, blob: Any) -> None:
        self.path = storage.full(name)
        self.size = int(blob.size)
        self.ident = (blob.generation, blob.updated)
        self._first: bytearray | None = None
        self._reads = ObjectReads(storage.bucket, storage.key(name), blob.generation, self.size, self.path,
                                  storage.opts.part_size, storage.opts.concurrency, storage.stats.add,
                                  retry=storage.retry, timeout=storage.opts.timeout)

    def read_into(self, offset: int, buf: Any, *, entry: str | None = None) -> None:
        mv = memoryview(buf).cast("B")
        if 0 <= offset and offset + len(mv) <= min(_HEAD, self.size) and len(mv) < _HEAD:
            if self._first is None:
                first = bytearray(min(_HEAD, self.size))
                self._reads.read([(0, first)], entry)
                self._first = first
            mv[:] = self._first[offset:offset + len(mv)]
            return
        self._reads.read([(offset, buf)], entry)

    def read_batch(self, fetches: list[tuple[int, Any]], *, entry: str | None = None) -> None:
        self._reads.read(fetches, entry)


class GCSStorage(CheckpointStorage):
    """The checkpoint at ``gs://BUCKET/PREFIX`` (see the module docstring)."""

    can_map = False

    def __init__(self, url: str, options: Mapping[str, Any] | None = None) -> None:
        from google.api_core.retry import Retry
        self.location = url.rstrip("/")
        self.bucket_name, self.prefix = parse_url(url)
        self.opts = GCSOptions.of(options)
        self.client = client_for(self.opts, self.location)
        self.bucket = self.client.bucket(self.bucket_name)
        # google's retries are bounded by time, not count: ``retries`` more request timeouts at most
        self.retry = Retry(initial=0.1, maximum=5.0, timeout=self.opts.timeout * self.opts.retries or 0.001)
        self.stats = _Stats()
        self._held: GenerationLock | None = None
        self._versions: dict[str, int] = {}

    def key(self, name: str) -> str:
        if not name or name.startswith("/") or any(p in ("", ".", "..") for p in name.split("/")):
            raise UnsafePathError(f"file name {name!r} leaves the checkpoint's prefix", path=self.location)
        return f"{self.prefix}/{name}" if self.prefix else name

    def full(self, name: str) -> str:
        return f"{self.location}/{name}"

    def _dir(self) -> str:
        return f"{self.prefix}/" if self.prefix else ""

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

    def is_location(self) -> bool:
        try:
            return any(True for _ in self.client.list_blobs(self.bucket_name, prefix=self._dir(), max_results=1,
                                                              retry=self.retry))
        except Exception as e:
            err = storage_error(e, self.location, what="listing the checkpoint")
            if isinstance(err, CheckpointNotFoundError):
                return False
            raise err from e

    def open_file(self, name: str) -> GCSFile:
        blob = self._blob(name)
        if blob is None:
            raise IncompleteCheckpointError("no such object", path=self.full(name))
        return GCSFile(self, name, blob)

    def list(self) -> list[str]:
        d = self._dir()
        try:
            names = [b.name[len(d):] for b in self.client.list_blobs(self.bucket_name, prefix=d, delimiter="/",
                                                                                  retry=self.retry)]
        except Exception as e:
            err = storage_error(e, self.location, what="listing the checkpoint")
            if isinstance(err, CheckpointNotFoundError):
                return []
            raise err from e
        return [n for n in names if n and "/" not in n and n != LOCK_NAME]

    def prepare(self) -> None:
        if not self._bucket_exists():
            raise CheckpointWriteError(f"no such bucket {self.bucket_name!r} (create it first, or check the URL)",
                                       path=self.location)

    def create_file(self, name: str, size: int | None, *, head: int, direct: bool, sync: bool) -> ComposedOutput:
        return ComposedOutput(self.bucket, self.key(name), self.full(name), size, head=head,
                              part_size=self.opts.upload_part_size, concurrency=self.opts.upload_concurrency,
                              retry=self.retry)

    def commit(self, name: str, data: bytes, *, sync: bool) -> None:
        held = self._holding()
        blob = self.bucket.blob(self.key(name))
        try:
            if held is None:
                blob.upload_from_string(bytes(data), retry=self.retry)
                return
            held.check()
            blob.upload_from_string(bytes(data), if_generation_match=self._versions.get(name, 0), retry=self.retry)
            self._versions[name] = int(blob.generation or 0)
        except CheckpointError:
            raise
        except Exception as e:
            if is_precondition_failed(e):
                raise CheckpointWriteError(
                    "this save's commit was refused: the object changed since the save took the location's lock "
                    "(another save committed after this one stalled past its lease); this save did not commit, the "
                    "checkpoint is the other save's. Save again", path=self.full(name)) from None
            raise write_error(e, self.full(name), what="committing the metadata failed") from e

    def _holding(self) -> GenerationLock | None:
        if self._held is not None and self._held.released:
            self._held = None
        return self._held

    def remove(self, names: Iterable[str], *, sync: bool) -> None:
        names = list(names)
        held = self._holding()
        if names and held is not None and not held.holds():
            return
        for n in names:
            try:
                self.bucket.blob(self.key(n)).delete()
            except Exception:
                pass

    def lock(self, *, shared: bool = False) -> Lock:
        if shared:
            return _NoLock()
        lock = GenerationLock(self.bucket, self.key(LOCK_NAME), self.full(LOCK_NAME), lease=self.opts.lock_lease,
                              wait=self.opts.lock_wait, job=job_identity(self.opts.lock_job),
                              require_preconditions=self.opts.require_preconditions)
        try:
            d = self._dir()
            self._versions = {b.name[len(d):]: int(b.generation) for b in
                              self.client.list_blobs(self.bucket_name, prefix=d, delimiter="/")}
        except BaseException as e:
            lock.release()
            if isinstance(e, Exception):
                raise write_error(e, self.location, what="listing the checkpoint") from e
            raise
        self._held = lock
        return lock

    def sync(self) -> None:
        """Nothing to do: an object is durable once its upload or compose has answered."""


class _NoLock(Lock):
    def release(self) -> None:
        pass
