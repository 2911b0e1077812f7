"""What every object-store storage shares (``s3://``, ``az://``, ``gs://``), over a few primitives of each store.

A checkpoint under ``SCHEME://BUCKET/PREFIX`` is its files as objects under ``PREFIX/``, byte for byte.
The parts that do not depend on the store live here, once:

- naming: a file's key under the prefix (names leaving it refused), its URL, the sibling prefix;
- listing: the files of the prefix (not below it; the save lock's object is no file), and the files
  one level below it (a managed root's steps: :meth:`ObjectStorage.files_below`);
- the fenced commit: while this storage's save lock is held, a commit checks the lock first and then
  writes conditionally on the version of the object the save saw when it took the lock (none seen:
  only where there is still none), so a save that lost its lock never commits over another's; the
  refusal names what to do;
- removal: nothing once the lock is lost (another save may own those names now);
- the lock: taken with the versions of the objects under the prefix (one listing), what the commit is
  conditional on; a per-rank save takes none;
- reads: :class:`ObjectFile` keeps the first bytes of an object (a shard's magic, preamble and header
  are one request); :class:`TransferStats` counts what reads took.

Each store (``s3/storage.py``, ``azure/storage.py``, ``gcs/storage.py``) gives its listing, its writes
(plain and conditional), its deletes, its lock and how its errors read (``failures``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from typing import Any

from ..errors import CheckpointError, CheckpointNotFoundError, CheckpointWriteError, UnsafePathError
from .base import CheckpointStorage, Lock, StoredFile
from .failures import StoreFailures
from .leased_lock import LOCK_NAME, LeasedLock, NoLock

__all__ = ["ObjectStorage", "ObjectFile", "TransferStats", "HEAD_BYTES"]

#: The first bytes of an object read (and kept) at the first small read near its start: a shard's magic,
#: preamble and header usually fit, so opening a shard is one request.
HEAD_BYTES = 64 << 10


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


class ObjectFile(StoredFile):
    """One object open for ranged reads (``_reads``: the store's, with ``read(fetches, entry)``); its first
    ``HEAD_BYTES`` read once and kept (``_first``; ``_remember`` hands them to the storage, where it keeps them)."""

    _reads: Any
    _first: bytearray | None = None

    def _remember(self, first: bytearray) -> None:
        pass

    def read_into(self, offset: int, buf: Any, *, entry: str | None = None) -> None:
        mv = memoryview(buf).cast("B")
        if 0 <= offset and offset + len(mv) <= min(HEAD_BYTES, self.size) and len(mv) < HEAD_BYTES:
            # magic, preamble and header reads of a shard: one request for the file's first bytes, kept
            if self._first is None:
                first = bytearray(min(HEAD_BYTES, self.size))
                self._reads.read([(0, first)], entry)
                self._first = first
                self._remember(first)
            mv[:] = self._first[offset:offset + len(mv)]
            return
        self._reads.read([(offset, buf)], entry)

    def read_batch(self, fetches: list[tuple[int, Any]], *, entry: str | None = None) -> None:
        self._reads.read(fetches, entry)

    def request_shape(self) -> tuple[int, int]:
        return self._reads.request_size(self.size), self._reads.concurrency

    def read_request(self, offset: int, buf: Any, *, entry: str | None = None) -> None:
        self._reads.read([(offset, buf)], entry, request_bytes=memoryview(buf).nbytes)


class ObjectStorage(CheckpointStorage):
    """A checkpoint at ``SCHEME://BUCKET/PREFIX`` (see the module docstring). A store's class sets ``location``
    and ``prefix`` and calls :meth:`_fresh` in its ``__init__``."""

    can_map = False
    location: str
    prefix: str
    #: what the store calls an object, for messages ("object", "blob")
    noun = "object"
    #: how the store's errors read (its ``failures.py``)
    failures: StoreFailures

    def _fresh(self) -> None:
        """Forget what was found of this location (a new storage, or a sibling made from this one)."""
        # the save lock this storage handed out and still holds, and the versions of the objects under the
        # prefix when it was taken: what a commit is conditional on (fencing)
        self._held: LeasedLock | None = None
        self._versions: dict[str, Any] = {}

    # ------------------------------------------------------------------ a store's primitives
    def _names(self) -> list[str]:
        """The names of the objects under the prefix (not below it), and of writes in progress there that
        :meth:`remove` clears; the store's errors raised."""
        raise NotImplementedError

    def _below(self) -> Iterator[tuple[str, int]]:
        """(name relative to the prefix, size) of every object under the prefix, at any depth."""
        raise NotImplementedError

    def _any_object(self) -> bool:
        """Whether any object is under the prefix (at any depth): one listing of one key."""
        raise NotImplementedError

    def _unfinished_below(self) -> list[str]:
        """Names relative to the prefix of writes in progress below it that are no objects (S3's uploads)."""
        return []

    def _put(self, name: str, data: bytes, seen: Any, *, fenced: bool) -> Any:
        """Write object ``name``: unconditionally, or (``fenced``) only while it is still version ``seen`` (None:
        only where there is none); its new version. A refused condition raises the store's error."""
        raise NotImplementedError

    def _delete(self, names: list[str]) -> None:
        """Delete these objects, ignoring errors (what stays is removed next time)."""
        raise NotImplementedError

    def _new_lock(self) -> LeasedLock:
        raise NotImplementedError

    def _current_versions(self) -> dict[str, Any]:
        """The version of every object under the prefix (not below it), by name: one listing."""
        raise NotImplementedError

    def _forget(self, name: str) -> None:
        """Drop what this storage keeps of object ``name`` (it is being written or removed)."""

    # ------------------------------------------------------------------ naming
    def key(self, name: str) -> str:
        """The object key of file ``name`` (refused where it would leave the prefix)."""
        if not name or name.startswith("/") or any(p in ("", ".", "..") for p in name.split("/")):
            raise UnsafePathError(f"file name {name!r} leaves the checkpoint's prefix", path=self.location)
        return f"{self.prefix}/{name}" if self.prefix else name

    def full(self, name: str) -> str:
        return f"{self.location}/{name}"

    def _dir(self) -> str:
        return f"{self.prefix}/" if self.prefix else ""

    def sibling(self, name: str) -> ObjectStorage:
        """The prefix ``name`` beside this one (``""``: the parent), with this one's client and settings."""
        if not self.prefix or (name and ("/" in name or name in (".", ".."))):
            raise UnsafePathError(f"no sibling {name!r} of this prefix", path=self.location)
        parent = self.prefix.rsplit("/", 1)[0] if "/" in self.prefix else ""
        key = f"{parent}/{name}".strip("/")
        bucket = self.location[:len(self.location) - len(self.prefix)].rstrip("/")
        other = object.__new__(type(self))  # this one's client and settings, another prefix, nothing found yet
        other.__dict__.update(self.__dict__)
        other.location, other.prefix = f"{bucket}/{key}".rstrip("/"), key
        other._fresh()
        return other

    # ------------------------------------------------------------------ listing
    def list(self) -> list[str]:
        """The objects under the prefix (not below it), and the names of writes still in progress there (a
        killed save's, which :meth:`remove` clears, as a local save's temporary files are removed)."""
        try:
            names = self._names()
        except Exception as e:
            err = self.failures.storage_error(e, self.location, what="listing the checkpoint")
            if isinstance(err, CheckpointNotFoundError):
                return []
            raise err from e
        return [n for n in names if n and "/" not in n and n != LOCK_NAME]

    def is_location(self) -> bool:
        try:
            return self._any_object()
        except Exception as e:
            err = self.failures.storage_error(e, self.location, what="listing the checkpoint")
            if isinstance(err, CheckpointNotFoundError):
                return False
            raise err from e

    def files_below(self) -> dict[str, int]:
        """Every object one level below the prefix, ``CHILD/NAME`` -> its size (lock objects included), in one
        listing (a missing bucket raises ``CheckpointNotFoundError``)."""
        out: dict[str, int] = {}
        try:
            for name, size in self._below():
                top, _, rest = name.partition("/")
                if top and rest and "/" not in rest:
                    out[name] = size
        except Exception as e:  # a missing bucket too: a root that names one is a mistake to show, not "no steps"
            raise self.failures.storage_error(e, self.location, what="listing the locations below") from e
        return out

    def unfinished_below(self) -> list[str]:
        """``CHILD/NAME`` of the writes in progress one level below the prefix that are no objects (a killed
        save's S3 multipart uploads; none on Azure, whose uncommitted blocks no listing shows, nor on GCS, whose
        parts are objects)."""
        try:
            names = self._unfinished_below()
        except Exception as e:
            raise self.failures.storage_error(e, self.location, what="listing the uploads below") from e
        return [n for n in names if n.count("/") == 1]

    # ------------------------------------------------------------------ writing
    def commit(self, name: str, data: bytes, *, sync: bool) -> None:
        self._forget(name)
        held = self._holding()
        try:
            if held is None:
                self._put(name, bytes(data), None, fenced=False)
                return
            held.check()
            self._versions[name] = self._put(name, bytes(data), self._versions.get(name), fenced=True)
        except CheckpointError:
            raise
        except Exception as e:
            if self.failures.refused(e):
                raise CheckpointWriteError(
                    f"this save's commit was refused: the {self.noun} changed since the save took the location's "
                    "lock (another save committed after this one stalled past its lease); this save did not commit, "
                    "the checkpoint is the other save's. Save again", path=self.full(name)) from None
            raise self.failures.write_error(e, self.full(name), what="committing the metadata failed") from e

    def _holding(self) -> LeasedLock | None:
        """The save lock this storage holds (None: none, or released)."""
        if self._held is not None and self._held.released:
            self._held = None
        return self._held

    def remove(self, names: Iterable[str], *, sync: bool) -> None:
        """Delete these objects (and clear the writes in progress under these names: a killed save's); errors are
        ignored: what stays is removed next time."""
        names = list(names)
        held = self._holding()
        if names and held is not None and not held.holds():
            return  # lost the lock: another save may own these names now (what stays is removed next time)
        for n in names:
            self._forget(n)
        if names:
            self._delete(names)

    def lock(self, *, shared: bool = False) -> Lock:
        if shared:
            return NoLock()
        lock = self._new_lock()
        try:
            self._versions = self._current_versions()
        except BaseException as e:
            lock.release()
            if isinstance(e, Exception) and not isinstance(e, CheckpointError):
                raise self.failures.write_error(e, self.location, what="listing the checkpoint") from e
            raise
        self._held = lock
        return lock

    def sync(self) -> None:
        """Nothing to do: an object is durable once its write has answered."""
