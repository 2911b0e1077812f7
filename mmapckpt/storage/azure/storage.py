"""A checkpoint under an Azure Blob prefix: ``az://CONTAINER/PREFIX`` (also ``abfs://``).

The blobs are the local checkpoint's files, byte for byte, under ``PREFIX/`` (block blobs), as
on S3 (``storage/s3/storage.py``, whose shape this follows):

- Reading: :class:`BlobFile` is one blob version (size and ETag from its properties); every byte
  is read with ranged GETs into the caller's buffers (``reads.py``), conditional on that ETag. No
  mapping (``can_map`` False).
- Writing: shards are staged blocks committed by one block list (``uploads.py``) under names no
  commit uses (``storage/commits.py`` ``shard_name``); the commit is one Put Blob of ``.metadata``,
  atomic (readers see the old blob or the new one); what no commit references is removed after it.
- Locking: an Azure lease on ``PREFIX/.mmapckpt-lock`` (``lock.py``). While it is held, a commit
  renews the lease first and is then conditional on the version of the blob the save saw when it
  took the lock (``If-Match`` its ETag, ``If-None-Match: *`` where there was none); :meth:`remove`
  removes nothing once the lock is lost.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from typing import Any

from ...errors import CheckpointError, CheckpointNotFoundError, CheckpointWriteError, IncompleteCheckpointError, \
    UnsafePathError
from ..base import CheckpointStorage, Lock, StoredFile
from ..holders import job_identity
from .failures import is_conflict, is_missing, storage_error, write_error
from .lock import LOCK_NAME, BlobLeaseLock
from .options import AzureOptions, client_for, parse_url
from .reads import BlobReads
from .uploads import BlobOutput

__all__ = ["AzureStorage", "BlobFile"]

#: The first bytes of a blob, read (and kept) at its first small read near its start: a shard's header
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


class BlobFile(StoredFile):
    """One blob, open for ranged reads of the version it had when opened."""

    def __init__(self, storage: AzureStorage, name: str, size: int, etag: str, modified: Any) -> None:
        self.path = storage.full(name)
        self.size = size
        self.ident = (etag, modified)
        self._first: bytearray | None = None
        self._reads = BlobReads(storage.blob(name), etag, size, self.path, storage.opts.part_size,
                                storage.opts.concurrency, storage.stats.add)

    def read_into(self, offset: int, buf: Any, *, entry: str | None = None) -> None:
        mv = memoryview(buf).cast("B")
        if 0 <= offset and offset + len(mv) <= min(_HEAD, self.size) and len(mv) < _HEAD:
            if self._first is None:  # magic, preamble and header reads of a shard: one request, kept
                first = bytearray(min(_HEAD, self.size))
                self._reads.read([(0, first)], entry)
                self._first = first
            mv[:] = self._first[offset:offset + len(mv)]
            return
        self._reads.read([(offset, buf)], entry)

    def read_batch(self, fetches: list[tuple[int, Any]], *, entry: str | None = None) -> None:
        self._reads.read(fetches, entry)


class AzureStorage(CheckpointStorage):
    """The checkpoint at ``az://CONTAINER/PREFIX`` (see the module docstring)."""

    can_map = False

    def __init__(self, url: str, options: Mapping[str, Any] | None = None) -> None:
        self.location = url.rstrip("/")
        self.container, self.prefix, account = parse_url(url)
        self.opts = AzureOptions.of(options, account)
        self.client = client_for(self.opts, self.container, self.location)
        #: bytes and requests of every read made through this storage
        self.stats = _Stats()
        self._held: BlobLeaseLock | None = None
        self._versions: dict[str, str] = {}  # ETags under the prefix when the lock was taken (fencing)

    # ------------------------------------------------------------------ naming
    def key(self, name: str) -> str:
        """The blob name of file ``name`` (refused where it would leave the prefix)."""
        if not name or name.startswith("/") or any(p in ("", ".", "..") for p in name.split("/")):
            raise UnsafePathError(f"file name {name!r} leaves the checkpoint's prefix", path=self.location)
        return f"{self.prefix}/{name}" if self.prefix else name

    def full(self, name: str) -> str:
        return f"{self.location}/{name}"

    def blob(self, name: str) -> Any:
        return self.client.get_blob_client(self.key(name))

    def _dir(self) -> str:
        return f"{self.prefix}/" if self.prefix else ""

    # ------------------------------------------------------------------ reading
    def _properties(self, name: str) -> Any:
        try:
            return self.blob(name).get_blob_properties()
        except Exception as e:
            if is_missing(e):
                return None
            raise storage_error(e, self.full(name), what="looking for the blob") from e

    def exists(self, name: str) -> bool:
        return self._properties(name) is not None

    def is_location(self) -> bool:
        try:
            return any(True for _ in self.client.list_blobs(name_starts_with=self._dir(), results_per_page=1))
        except Exception as e:
            err = storage_error(e, self.location, what="listing the checkpoint")
            if isinstance(err, CheckpointNotFoundError):
                return False
            raise err from e

    def open_file(self, name: str) -> BlobFile:
        p = self._properties(name)
        if p is None:
            raise IncompleteCheckpointError("no such blob", path=self.full(name))
        return BlobFile(self, name, int(p.size), p.etag, p.last_modified)

    def list(self) -> list[str]:
        """The blobs under the prefix (not below it); uncommitted blocks of killed saves are no blobs."""
        d = self._dir()
        try:
            names = [b.name[len(d):] for b in self.client.walk_blobs(name_starts_with=d, delimiter="/")
                     if not b.name.endswith("/")]
        except Exception as e:
            err = storage_error(e, self.location, what="listing the checkpoint")
            if isinstance(err, CheckpointNotFoundError):
                return []
            raise err from e
        return [n for n in names if n and "/" not in n and n != LOCK_NAME]

    # ------------------------------------------------------------------ writing
    def prepare(self) -> None:
        try:
            self.client.get_container_properties()
        except Exception as e:
            if getattr(e, "status_code", None) == 404:
                raise CheckpointWriteError(f"no such container {self.container!r} (create it first, or check the "
                                           "URL)", path=self.location) from None
            raise write_error(e, self.location, what=f"the container {self.container!r} cannot be written") from e

    def create_file(self, name: str, size: int | None, *, head: int, direct: bool, sync: bool) -> BlobOutput:
        return BlobOutput(self.blob(name), self.full(name), size, head=head, part_size=self.opts.upload_part_size,
                          concurrency=self.opts.upload_concurrency)

    def commit(self, name: str, data: bytes, *, sync: bool) -> None:
        from azure.core import MatchConditions
        held = self._holding()
        blob = self.blob(name)
        try:
            if held is None:
                blob.upload_blob(bytes(data), overwrite=True, max_concurrency=1)
                return
            held.check()
            seen = self._versions.get(name)
            if seen is None:
                r = blob.upload_blob(bytes(data), overwrite=False, max_concurrency=1)
            else:
                r = blob.upload_blob(bytes(data), overwrite=True, etag=seen,
                                     match_condition=MatchConditions.IfNotModified, max_concurrency=1)
            self._versions[name] = r["etag"]
        except CheckpointError:
            raise
        except Exception as e:
            if is_conflict(e):
                raise CheckpointWriteError(
                    "this save's commit was refused: the blob changed since the save took the location's lock "
                    "(another save committed after this one stalled past its lease); this save did not commit, the "
                    "checkpoint is the other save's. Save again", path=self.full(name)) from None
            raise write_error(e, self.full(name), what="committing the metadata failed") from e

    def _holding(self) -> BlobLeaseLock | None:
        if self._held is not None and self._held.released:
            self._held = None
        return self._held

    def remove(self, names: Iterable[str], *, sync: bool) -> None:
        """Delete these blobs; errors are ignored (what stays is removed next time)."""
        names = list(names)
        held = self._holding()
        if names and held is not None and not held.holds():
            return  # lost the lock: another save may own these names now
        for i in range(0, len(names), 256):  # a batch delete takes at most 256 blobs
            try:
                self.client.delete_blobs(*[self.key(n) for n in names[i:i + 256]])
            except Exception:
                for n in names[i:i + 256]:  # a service without batches (an emulator): one by one
                    try:
                        self.blob(n).delete_blob()
                    except Exception:
                        pass

    def lock(self, *, shared: bool = False) -> Lock:
        if shared:
            return _NoLock()
        lock = BlobLeaseLock(self.blob(LOCK_NAME), self.full(LOCK_NAME), lease=self.opts.lease_seconds,
                             wait=self.opts.lock_wait, job=job_identity(self.opts.lock_job))
        try:
            d = self._dir()
            self._versions = {b.name[len(d):]: b.etag for b in self.client.list_blobs(name_starts_with=d)}
        except BaseException as e:
            lock.release()
            if isinstance(e, Exception):
                raise write_error(e, self.location, what="listing the checkpoint") from e
            raise
        self._held = lock
        return lock

    def sync(self) -> None:
        """Nothing to do: a blob is durable once its Put Blob or Put Block List has answered."""


class _NoLock(Lock):
    """The lock of a per-rank save: none (its ranks write disjoint blobs)."""

    def release(self) -> None:
        pass
