"""A checkpoint under an object-store prefix: ``s3://BUCKET/PREFIX``, the second implementation of the seam.

The objects are the local checkpoint's files, byte for byte, under ``PREFIX/``: the per-rank
shard objects, ``.metadata``, per-rank commits (so ``aws s3 sync`` of a local checkpoint is a
checkpoint here, and back).

- Reading: :class:`S3File` is one object version (its size and ETag from a HEAD); every byte is
  read with ranged GETs straight into the caller's buffer (``reads.py``), conditional on that
  ETag. There is no mapping (``can_map`` False): readers build tensors by reading.
- Writing: shards are multipart uploads (``uploads.py``) under names no commit uses
  (``storage/commits.py`` ``shard_name``), so no object a committed checkpoint references is
  ever overwritten; the commit is one PUT of ``.metadata``, atomic on S3 (readers see the old
  object or the new one); what no commit references is removed after it.
- Removing: after a commit, what no commit references (``storage/commits.py`` ``remove_stale``);
  uploads left in progress by a killed save are listed as files and aborted as they are removed.
- Locking: a leased lock object created with a conditional write (``lock.py``, over
  ``storage/leased_lock.py``). The commit is fenced by it (``storage/object_store.py``, for every
  store): while this storage's lock is held, a commit checks the lock first and then PUTs
  conditionally on the version of the object the save saw when it took the lock (``If-Match`` its
  ETag, ``If-None-Match: *`` where there was none), and :meth:`remove` removes nothing once the lock
  is lost.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from ...errors import CheckpointError, CheckpointWriteError, IncompleteCheckpointError, TruncatedFileError
from ..holders import job_identity
from ..leased_lock import LeasedLock
from ..object_store import HEAD_BYTES, ObjectFile, ObjectStorage, TransferStats
from .failures import FAILURES, error_code, is_missing, storage_error, write_error
from .lock import LOCK_NAME, S3Lock, put_if
from .options import S3Options, client_for, parse_url
from .reads import ObjectReads
from .uploads import S3Output
from .versions import ObjectVersions

__all__ = ["S3Storage", "S3File", "TransferStats"]

_HEAD = HEAD_BYTES


class S3File(ObjectFile):
    """One object, open for ranged reads of the version it had when opened."""

    def __init__(self, storage: S3Storage, name: str, head: dict[str, Any]) -> None:
        self.path = storage.full(name)
        self.size = int(head["ContentLength"])
        etag = head.get("ETag")
        self.ident = (etag, head.get("LastModified"))
        self._first = storage._first_bytes.get((name, etag))  # the first _HEAD bytes, once read
        self._remember = lambda first: storage._first_bytes.__setitem__((name, etag), first)  # type: ignore[method-assign]
        self._reads = ObjectReads(storage.client, storage.bucket, storage.key(name), etag, self.size, self.path,
                                  storage.opts, storage.stats.add)


class S3Storage(ObjectVersions, ObjectStorage):
    """The checkpoint at ``s3://BUCKET/PREFIX`` (see the module docstring)."""

    failures = FAILURES

    def __init__(self, url: str, options: Mapping[str, Any] | None = None) -> None:
        self.location = url.rstrip("/")
        self.bucket, self.prefix = parse_url(url)
        self.opts = S3Options.of(options)
        self.client = client_for(self.opts)
        #: bytes and requests of every read made through this storage
        self.stats = TransferStats()
        self._fresh()

    def _fresh(self) -> None:
        super()._fresh()
        self._uploads: dict[str, list[str]] = {}  # name -> ids of uploads in progress, as list() found them
        # what this storage found of its objects (a load opens .metadata and each shard several times):
        # HEADs by name, dropped when this storage writes or removes the name; first bytes by (name, ETag)
        self._heads: dict[str, dict[str, Any]] = {}
        self._first_bytes: dict[tuple[str, str | None], bytearray] = {}

    def _forget(self, name: str) -> None:
        self._heads.pop(name, None)

    # ------------------------------------------------------------------ reading
    def _head(self, name: str) -> dict[str, Any] | None:
        """What the object ``name`` is (size, ETag), or None where there is none: one GET of its first
        ``_HEAD`` bytes, which are kept for the reads that follow (a shard's header, a small file whole),
        so that opening a file and reading its start is one request, not a HEAD and a GET."""
        found = self._heads.get(name)
        if found is not None:
            return found
        key = self.key(name)
        try:
            r = self.client.get_object(Bucket=self.bucket, Key=key, Range=f"bytes=0-{_HEAD - 1}")
            first = r["Body"].read()
        except CheckpointError:
            raise
        except Exception as e:
            if is_missing(e):
                return None
            if error_code(e) != "InvalidRange":  # an empty object has no byte 0
                raise storage_error(e, self.full(name), what="looking up the object") from e
            try:
                found = self.client.head_object(Bucket=self.bucket, Key=key)
            except Exception as e2:
                if is_missing(e2):
                    return None
                raise storage_error(e2, self.full(name), what="looking up the object") from e2
        else:
            total = r.get("ContentRange", "").rpartition("/")[2]
            size = int(total) if total.isdigit() else len(first)
            if len(first) != min(size, _HEAD):
                raise TruncatedFileError(f"the store sent {len(first)} of the first {min(size, _HEAD)} bytes",
                                         path=self.full(name))
            found = {"ContentLength": size, "ETag": r.get("ETag"), "LastModified": r.get("LastModified")}
            self._first_bytes[(name, found["ETag"])] = bytearray(first)
            self.stats.add(len(first), 1)
        self._heads[name] = found  # type: ignore[assignment]
        return found

    def exists(self, name: str) -> bool:
        return self._head(name) is not None

    def is_location(self) -> bool:
        """As every store's, but a missing bucket is raised (``CheckpointNotFoundError`` naming it), not "no"."""
        try:
            r = self.client.list_objects_v2(Bucket=self.bucket, Prefix=self._dir(), MaxKeys=1)
        except Exception as e:
            raise storage_error(e, self.location, what="listing the checkpoint") from e
        return bool(r.get("KeyCount") or r.get("Contents"))

    def open_file(self, name: str) -> S3File:
        head = self._head(name)
        if head is None:
            raise IncompleteCheckpointError("no such object", path=self.full(name))
        return S3File(self, name, head)

    def _names(self) -> list[str]:
        """The objects under the prefix, and the names of uploads still in progress there (kept for :meth:`remove`,
        which aborts them)."""
        names: list[str] = []
        uploads: dict[str, list[str]] = {}
        d = self._dir()
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=d, Delimiter="/"):
            names += [o["Key"][len(d):] for o in page.get("Contents", ())]
        for page in self.client.get_paginator("list_multipart_uploads").paginate(Bucket=self.bucket, Prefix=d,
                                                                                  Delimiter="/"):
            for u in page.get("Uploads", ()):
                uploads.setdefault(u["Key"][len(d):], []).append(u["UploadId"])
        self._uploads = uploads
        seen = set(names)
        return names + [n for n in uploads if n not in seen]

    def _below(self) -> Iterator[tuple[str, int]]:
        d = self._dir()
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=d):
            for o in page.get("Contents", ()):
                yield o["Key"][len(d):], int(o["Size"])

    def _unfinished_below(self) -> list[str]:
        d = self._dir()
        pages = self.client.get_paginator("list_multipart_uploads").paginate(Bucket=self.bucket, Prefix=d)
        return [u["Key"][len(d):] for page in pages for u in page.get("Uploads", ())]

    # ------------------------------------------------------------------ writing
    def prepare(self) -> None:
        try:
            self.client.head_bucket(Bucket=self.bucket)
        except Exception as e:
            if is_missing(e):  # HEAD has no body: a missing bucket is a bare 404
                raise CheckpointWriteError(f"no such bucket {self.bucket!r} (create it first, or check the URL)",
                                           path=self.location) from None
            raise write_error(e, self.location, what=f"the bucket {self.bucket!r} cannot be written") from e

    def create_file(self, name: str, size: int | None, *, head: int, direct: bool, sync: bool) -> S3Output:
        self._heads.pop(name, None)
        return S3Output(self.client, self.bucket, self.key(name), self.full(name), size, head=head, opts=self.opts)

    def _put(self, name: str, data: bytes, seen: Any, *, fenced: bool) -> Any:
        if not fenced:
            return self.client.put_object(Bucket=self.bucket, Key=self.key(name), Body=data).get("ETag", "")
        return put_if(self.client, self.bucket, self.key(name), data, seen).get("ETag", "")

    def _delete(self, names: list[str]) -> None:
        """Delete these objects and abort the uploads in progress under these names (a killed save's)."""
        keys = [{"Key": self.key(n)} for n in names]
        for i in range(0, len(keys), 1000):  # DeleteObjects takes at most 1000 keys
            try:
                self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": keys[i:i + 1000], "Quiet": True})
            except Exception:
                pass
        for n in names:
            for upload_id in self._uploads.pop(n, ()):
                try:
                    self.client.abort_multipart_upload(Bucket=self.bucket, Key=self.key(n), UploadId=upload_id)
                except Exception:
                    pass

    def _new_lock(self) -> LeasedLock:
        return S3Lock(self.client, self.bucket, self.key(LOCK_NAME), self.full(LOCK_NAME), lease=self.opts.lock_lease,
                      wait=self.opts.lock_wait, job=job_identity(self.opts.lock_job))

    def _current_versions(self) -> dict[str, str]:
        """The ETag of every object under the prefix (not below it), by name: one listing."""
        d, out = self._dir(), {}
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=d, Delimiter="/"):
            out.update((o["Key"][len(d):], o["ETag"]) for o in page.get("Contents", ()))
        return out
