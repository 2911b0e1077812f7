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

from collections.abc import Iterator, Mapping
from typing import Any

from ...errors import CheckpointWriteError, IncompleteCheckpointError
from ..holders import job_identity
from ..leased_lock import LeasedLock
from ..object_store import ObjectFile, ObjectStorage, TransferStats
from .failures import FAILURES, is_missing, storage_error, write_error
from .lock import LOCK_NAME, BlobLeaseLock
from .options import AzureOptions, client_for, parse_url
from .reads import BlobReads
from .uploads import BlobOutput

__all__ = ["AzureStorage", "BlobFile"]


class BlobFile(ObjectFile):
    """One blob, open for ranged reads of the version it had when opened."""

    def __init__(self, storage: AzureStorage, name: str, size: int, etag: str, modified: Any) -> None:
        self.path = storage.full(name)
        self.size = size
        self.ident = (etag, modified)
        self._reads = BlobReads(storage.blob(name), etag, size, self.path, storage.opts.part_size,
                                storage.opts.concurrency, storage.stats.add, retries=storage.opts.retries)


class AzureStorage(ObjectStorage):
    """The checkpoint at ``az://CONTAINER/PREFIX`` (see the module docstring)."""

    failures = FAILURES

    noun = "blob"

    def __init__(self, url: str, options: Mapping[str, Any] | None = None) -> None:
        self.location = url.rstrip("/")
        self.container, self.prefix, account = parse_url(url)
        self.opts = AzureOptions.of(options, account)
        self.client = client_for(self.opts, self.container, self.location)
        #: bytes and requests of every read made through this storage
        self.stats = TransferStats()
        self._fresh()

    def blob(self, name: str) -> Any:
        return self.client.get_blob_client(self.key(name))

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

    def _any_object(self) -> bool:
        return any(True for _ in self.client.list_blobs(name_starts_with=self._dir(), results_per_page=1))

    def open_file(self, name: str) -> BlobFile:
        p = self._properties(name)
        if p is None:
            raise IncompleteCheckpointError("no such blob", path=self.full(name))
        return BlobFile(self, name, int(p.size), p.etag, p.last_modified)

    def _names(self) -> list[str]:
        """The blobs under the prefix (not below it); uncommitted blocks of killed saves are no blobs."""
        d = self._dir()
        return [b.name[len(d):] for b in self.client.walk_blobs(name_starts_with=d, delimiter="/")
                if not b.name.endswith("/")]

    def _below(self) -> Iterator[tuple[str, int]]:
        d = self._dir()
        for b in self.client.list_blobs(name_starts_with=d):
            yield b.name[len(d):], int(b.size or 0)

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

    def _put(self, name: str, data: bytes, seen: Any, *, fenced: bool) -> Any:
        from azure.core import MatchConditions
        blob = self.blob(name)
        if not fenced:
            return blob.upload_blob(data, overwrite=True, max_concurrency=1)["etag"]
        if seen is None:
            return blob.upload_blob(data, overwrite=False, max_concurrency=1)["etag"]
        return blob.upload_blob(data, overwrite=True, etag=seen, match_condition=MatchConditions.IfNotModified,
                                max_concurrency=1)["etag"]

    def _delete(self, names: list[str]) -> None:
        for i in range(0, len(names), 256):  # a batch delete takes at most 256 blobs
            try:
                self.client.delete_blobs(*[self.key(n) for n in names[i:i + 256]])
            except Exception:
                for n in names[i:i + 256]:  # a service without batches (an emulator): one by one
                    try:
                        self.blob(n).delete_blob()
                    except Exception:
                        pass

    def _new_lock(self) -> LeasedLock:
        return BlobLeaseLock(self.blob(LOCK_NAME), self.full(LOCK_NAME), lease=self.opts.lease_seconds,
                             wait=self.opts.lock_wait, job=job_identity(self.opts.lock_job))

    def _current_versions(self) -> dict[str, str]:
        d = self._dir()
        return {b.name[len(d):]: b.etag for b in self.client.list_blobs(name_starts_with=d)}
