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
- Locking: a leased lock object created with a conditional write (``lock.py``). The commit is
  fenced by it: while this storage's lock is held, :meth:`S3Storage.commit` checks the lock first
  and then PUTs conditionally on the version of the object the save saw when it took the lock
  (``If-Match`` its ETag, ``If-None-Match: *`` where there was none), and :meth:`S3Storage.remove`
  removes nothing once the lock is lost.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from typing import Any

from ...errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointWriteError,
    IncompleteCheckpointError,
    TruncatedFileError,
    UnsafePathError,
)
from ..base import CheckpointStorage, Lock, StoredFile
from ..holders import job_identity
from .failures import error_code, is_missing, is_precondition_failed, storage_error, write_error
from .lock import LOCK_NAME, S3Lock, put_if
from .options import S3Options, client_for, parse_url
from .reads import ObjectReads
from .uploads import S3Output
from .versions import ObjectVersions

__all__ = ["S3Storage", "S3File", "TransferStats"]


class TransferStats:
    """What a storage's reads took from the store: bytes received and GET requests (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.bytes = 0
        self.requests = 0

    def add(self, nbytes: int, requests: int) -> None:
        with self._lock:
            self.bytes += nbytes
            self.requests += requests


#: The first bytes of an object read (and kept) at the first small read near its start: a shard's magic,
#: preamble and header usually fit, so opening a shard is one request.
_HEAD = 64 << 10


class S3File(StoredFile):
    """One object, open for ranged reads of the version it had when opened."""

    def __init__(self, storage: S3Storage, name: str, head: dict[str, Any]) -> None:
        self.path = storage.full(name)
        self.size = int(head["ContentLength"])
        etag = head.get("ETag")
        self.ident = (etag, head.get("LastModified"))
        self._head = storage._first_bytes.get((name, etag))  # the first _HEAD bytes, once read
        self._remember = lambda head: storage._first_bytes.__setitem__((name, etag), head)
        self._reads = ObjectReads(storage.client, storage.bucket, storage.key(name), etag, self.size, self.path,
                                  storage.opts, storage.stats.add)

    def read_into(self, offset: int, buf: Any, *, entry: str | None = None) -> None:
        mv = memoryview(buf).cast("B")
        if 0 <= offset and offset + len(mv) <= min(_HEAD, self.size) and len(mv) < _HEAD:
            # magic, preamble and header reads of a shard: one request for the file's first bytes, kept
            if self._head is None:
                head = bytearray(min(_HEAD, self.size))
                self._reads.read([(0, head)], entry)
                self._head = head
                self._remember(head)
            mv[:] = self._head[offset:offset + len(mv)]
            return
        self._reads.read([(offset, buf)], entry)

    def read_batch(self, fetches: list[tuple[int, Any]], *, entry: str | None = None) -> None:
        self._reads.read(fetches, entry)


def _sibling(storage: S3Storage, name: str) -> S3Storage:
    """``S3Storage.sibling``: the prefix ``name`` beside this one (``""``: the parent), with its client and settings."""
    if not storage.prefix or (name and ("/" in name or name in (".", ".."))):
        raise UnsafePathError(f"no sibling {name!r} of this prefix", path=storage.location)
    parent = storage.prefix.rsplit("/", 1)[0] if "/" in storage.prefix else ""
    key = f"{parent}/{name}".strip("/")
    other = object.__new__(S3Storage)  # this one's client and settings, another prefix, nothing found yet
    other.__dict__.update(storage.__dict__)
    other.location, other.prefix = f"s3://{storage.bucket}/{key}".rstrip("/"), key
    other._uploads, other._heads, other._first_bytes, other._held, other._versions = {}, {}, {}, None, {}
    return other


class S3Storage(ObjectVersions, CheckpointStorage):
    """The checkpoint at ``s3://BUCKET/PREFIX`` (see the module docstring)."""

    can_map = False

    def __init__(self, url: str, options: Mapping[str, Any] | None = None) -> None:
        self.location = url.rstrip("/")
        self.bucket, self.prefix = parse_url(url)
        self.opts = S3Options.of(options)
        self.client = client_for(self.opts)
        #: bytes and requests of every read made through this storage
        self.stats = TransferStats()
        self._uploads: dict[str, list[str]] = {}  # name -> ids of uploads in progress, as list() found them
        # what this storage found of its objects (a load opens .metadata and each shard several times):
        # HEADs by name, dropped when this storage writes or removes the name; first bytes by (name, ETag)
        self._heads: dict[str, dict[str, Any]] = {}
        self._first_bytes: dict[tuple[str, str | None], bytearray] = {}
        # the save lock this storage handed out and still holds, and the ETags of the objects under the
        # prefix when it was taken: what a commit is conditional on (fencing)
        self._held: S3Lock | None = None
        self._versions: dict[str, str] = {}

    # ------------------------------------------------------------------ naming
    def key(self, name: str) -> str:
        """The object key of file ``name`` (refused where it would leave the prefix)."""
        if not name or name.startswith("/") or any(p in ("", ".", "..") for p in name.split("/")):
            raise UnsafePathError(f"file name {name!r} leaves the checkpoint's prefix", path=self.location)
        return f"{self.prefix}/{name}" if self.prefix else name

    def full(self, name: str) -> str:
        return f"{self.location}/{name}"

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

    def list(self) -> list[str]:
        """The objects under the prefix (not below it), and the names of uploads still in progress there
        (a killed save's, which :meth:`remove` aborts, as a local save's temporary files are removed)."""
        names: list[str] = []
        uploads: dict[str, list[str]] = {}
        d = self._dir()
        try:
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=d,
                                                                               Delimiter="/"):
                names += [o["Key"][len(d):] for o in page.get("Contents", ())]
            for page in self.client.get_paginator("list_multipart_uploads").paginate(Bucket=self.bucket, Prefix=d,
                                                                                      Delimiter="/"):
                for u in page.get("Uploads", ()):
                    uploads.setdefault(u["Key"][len(d):], []).append(u["UploadId"])
        except Exception as e:
            err = storage_error(e, self.location, what="listing the checkpoint")
            if isinstance(err, CheckpointNotFoundError):
                return []
            raise err from e
        self._uploads = uploads
        seen = set(names)
        names += [n for n in uploads if n not in seen]
        return [n for n in names if n and "/" not in n and n != LOCK_NAME]

    def _dir(self) -> str:
        return f"{self.prefix}/" if self.prefix else ""

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

    def commit(self, name: str, data: bytes, *, sync: bool) -> None:
        self._heads.pop(name, None)
        held = self._holding()
        try:
            if held is None:
                self.client.put_object(Bucket=self.bucket, Key=self.key(name), Body=bytes(data))
                return
            held.check()
            r = put_if(self.client, self.bucket, self.key(name), bytes(data), self._versions.get(name))
            self._versions[name] = r.get("ETag", "")
        except CheckpointError:
            raise
        except Exception as e:
            if is_precondition_failed(e):
                raise CheckpointWriteError(
                    "this save's commit was refused: the object changed since the save took the location's lock "
                    "(another save committed after this one stalled past its lease); this save did not commit, the "
                    "checkpoint is the other save's. Save again", path=self.full(name)) from None
            raise write_error(e, self.full(name), what="committing the metadata failed") from e

    def _holding(self) -> S3Lock | None:
        """The save lock this storage holds (None: none, or released)."""
        if self._held is not None and self._held.released:
            self._held = None
        return self._held

    def remove(self, names: Iterable[str], *, sync: bool) -> None:
        """Delete these objects and abort the uploads in progress under these names (a killed save's);
        errors are ignored: what stays is removed next time."""
        names = list(names)
        held = self._holding()
        if names and held is not None and not held.holds():
            return  # lost the lock: another save may own these names now (what stays is removed next time)
        for n in names:
            self._heads.pop(n, None)
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

    def lock(self, *, shared: bool = False) -> Lock:
        if shared:
            return _NoLock()
        lock = S3Lock(self.client, self.bucket, self.key(LOCK_NAME), self.full(LOCK_NAME), lease=self.opts.lock_lease,
                      wait=self.opts.lock_wait, job=job_identity(self.opts.lock_job))
        try:
            self._versions = self._etags()
        except BaseException:
            lock.release()
            raise
        self._held = lock
        return lock

    def _etags(self) -> dict[str, str]:
        """The ETag of every object under the prefix (not below it), by name: one listing."""
        d, out = self._dir(), {}
        try:
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=d,
                                                                               Delimiter="/"):
                out.update((o["Key"][len(d):], o["ETag"]) for o in page.get("Contents", ()))
        except Exception as e:
            raise write_error(e, self.location, what="listing the checkpoint") from e
        return out

    def sync(self) -> None:
        """Nothing to do: an object is durable once its PUT or its upload's completion has answered."""


class _NoLock(Lock):
    """The lock of a per-rank save on an object store: none (its ranks write disjoint objects)."""

    def release(self) -> None:
        pass


# The class is at the size limit of tests/test_architecture.py: its sibling (CheckpointStorage.sibling) is here.
S3Storage.sibling = _sibling  # type: ignore[method-assign,assignment]
