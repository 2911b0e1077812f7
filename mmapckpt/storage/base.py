"""Where a checkpoint's bytes live: the one interface every reader and writer goes through.

A checkpoint is a *location* (a local directory; an object-store prefix is the next
implementation) holding named files: the per-rank shard files, the ``.metadata`` commit,
per-rank commits, and files that are not the checkpoint's (configs, notes), which nothing
here removes. :class:`CheckpointStorage` is a location; every file of it is read through a
:class:`StoredFile` and every shard is written through a :class:`FileOutput`.

What each medium must provide, and what it may:

- reading any byte range of a file into a caller's buffer (:meth:`StoredFile.read_into`): a
  target tensor, a pinned staging buffer, a broadcast buffer. Every medium has it, and on a
  medium without mappings every byte is read through it. (A local file's bulk reads into
  targets and staging buffers are the same ``preadv``, batched and threaded by
  ``io/direct_reads.py`` over the mapped file: reading/moves.py.)
- a mapped view of the file (:attr:`StoredFile.mapping`): where the medium has one (local
  files), tensors are built over it without copying; elsewhere it is None and readers build
  tensors by reading (:attr:`CheckpointStorage.can_map` says which, before a file is opened).
- writing a shard as a stream of aligned pieces at ascending offsets, its head (the shard
  header, which holds the pieces' CRC-32s and is known last) at offset 0 at the end
  (:meth:`CheckpointStorage.create_file`); it appears under its name only once complete and
  durable (a temporary file renamed in; a multipart upload completed).
- committing the metadata atomically (:meth:`CheckpointStorage.commit`): old or new at every
  instant, the one commit point of a save.
- listing and removing files (:meth:`CheckpointStorage.list`, :meth:`CheckpointStorage.remove`),
  with which ``storage/commits.py`` removes what no commit references.
- locking the location against a concurrent save (:meth:`CheckpointStorage.lock`).

Names of files are relative to the location (``__0_0.distcp``); :meth:`CheckpointStorage.full`
gives the name used in messages (a path, a URL).
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Collection, Iterable
from typing import TYPE_CHECKING, Any

from ..errors import (BadMagicError, CheckpointError, CheckpointNotFoundError, FormatError, IncompleteCheckpointError,
                      TruncatedFileError)
from ..format.metadata import MAX_METADATA_SIZE, METADATA_NAME, metadata_kind
from ..io.mapped import MappedFile
from ..records import Record

if TYPE_CHECKING:
    from .replacement import Replacement

__all__ = ["CheckpointStorage", "StoredFile", "FileOutput", "Lock", "CommitFile"]


class StoredFile(abc.ABC):
    """One file of a checkpoint, open for reading.

    Attributes:
        path: its full name, for messages.
        size: its size when opened; no read reaches past it.
        ident: what identifies the file opened (``(st_dev, st_ino)`` of a local file), so that a
            file opened again can be told to be the same one.
    """

    path: str
    size: int
    ident: Any

    @abc.abstractmethod
    def read_into(self, offset: int, buf: Any, *, entry: str | None = None) -> None:
        """Fill ``buf`` (any writable buffer: a tensor's bytes, a staging buffer) with the bytes at ``offset``.

        Raises:
            TruncatedFileError: the file ends before ``buf`` is full.
        """

    def read_batch(self, fetches: list[tuple[int, Any]], *, entry: str | None = None) -> None:
        """:meth:`read_into` for each ``(offset, buffer)`` of ``fetches``; a medium may run them together
        (an object store: ranged GETs in parallel, neighbours joined into one request)."""
        for offset, buf in fetches:
            self.read_into(offset, buf, entry=entry)

    def request_shape(self) -> tuple[int, int]:
        """``(bytes, threads)``: the size of the requests a load of the whole file makes, and how many run at once
        (an object store's ranged GETs: :meth:`read_request` reads one); a medium without requests of its own: the
        whole file, one."""
        return self.size, 1

    def read_request(self, offset: int, buf: Any, *, entry: str | None = None) -> None:
        """:meth:`read_into` as one request of the medium (where ``read_into`` may split a long read among its
        threads), for a caller that runs several at once itself: the cache's fetch (storage/cache/entry.py)."""
        self.read_into(offset, buf, entry=entry)

    def read(self, offset: int, length: int, *, entry: str | None = None) -> bytearray:
        """``length`` bytes at ``offset``, in a new buffer; a range past the end raises TruncatedFileError first."""
        if offset < 0 or length < 0 or offset + length > self.size:
            raise TruncatedFileError(f"data [{offset}, +{length}) runs past the end of the {self.size}-byte file",
                                     path=self.path, entry=entry)
        buf = bytearray(length)
        if length:
            self.read_into(offset, buf, entry=entry)
        return buf

    @property
    def mapping(self) -> MappedFile | None:
        """The file mapped into memory (tensors are built over it without a copy), or None where the
        medium has no mapping: then every byte is read with :meth:`read_into`."""
        return None

    def check_unchanged(self) -> None:
        """Raise TruncatedFileError if the file shrank since it was opened (views of a mapping would fault)."""

    def close(self) -> None:
        """Release what the file holds open; a mapping stays valid for the views built over it."""

    def __enter__(self) -> StoredFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class FileOutput(abc.ABC):
    """One shard being written: aligned pieces at ascending offsets, then its head at offset 0.

    Nothing appears under the file's name until :meth:`finish` has made it complete and
    durable; :meth:`abort` leaves nothing behind.

    Attributes:
        path: the full name of the file it becomes, for messages.
        how: how its bytes travel (``"direct"``: O_DIRECT, ``"buffered"``, ...), reported by the writer.
    """

    path: str
    how: str

    @abc.abstractmethod
    def put(self, offset: int, data: Any) -> None:
        """Place ``data`` (a bytes-like object) at ``offset``, not before the end of the previous piece."""

    @abc.abstractmethod
    def finish(self, head: bytes) -> None:
        """Write ``head`` at offset 0 (it precedes every piece), make the file durable and put it in place."""

    def shrink(self, size: int) -> None:
        """Before :meth:`finish`: the file ends at ``size``, at most the size it was created with (a save that
        referred to stored chunks instead of writing them, writing/dedup.py). A medium that pads the file to its
        created size at :meth:`finish` keeps that size in ``self.size``, which this lowers."""
        if getattr(self, "size", None) is not None:
            self.size = size  # type: ignore[attr-defined]

    @abc.abstractmethod
    def abort(self) -> None:
        """Give up: remove what was written (also after a failed :meth:`finish`)."""


class Lock(abc.ABC):
    """A save's hold on a location, from planning to commit.

    The contract a medium's lock keeps (docs/object-storage.md): while a save holds it, no other
    save commits at the location, and a save that no longer holds it does not commit. A lock the
    kernel holds for a live process (a local ``flock``) is fenced by construction: it cannot be
    lost while its process runs, and it is gone with a dead one. A leased lock (an object store's)
    can be lost by a holder that stalls past its lease: such a medium checks the lock in
    :meth:`CheckpointStorage.commit` (:meth:`check`) and makes the commit conditional on what the
    save saw when it took the lock, and removes nothing once the lock is lost.
    """

    def check(self, what: str = "commit") -> None:
        """Raise CheckpointWriteError unless this lock is provably still held now (before the ``what``)."""

    @abc.abstractmethod
    def release(self) -> None:
        """Let the next save in (removing only this save's own hold, never another's)."""


class CommitFile(Record):
    """A commit file as read; ``kind`` is ``"mmapckpt"`` or ``"dcp"``."""

    __slots__ = ()

    name: str
    full: str
    kind: str
    data: bytes

    def __new__(cls, name: str, full: str, kind: str, data: bytes) -> CommitFile:
        return tuple.__new__(cls, (name, full, kind, data))


class CheckpointStorage(abc.ABC):
    """A checkpoint's location: its files, read, written, committed, listed, removed and locked.

    Attributes:
        location: the location as the user named it (a directory path).
        can_map: whether files opened here have a :attr:`StoredFile.mapping`.
    """

    location: str
    can_map: bool = False

    # ------------------------------------------------------------------ naming
    @abc.abstractmethod
    def full(self, name: str) -> str:
        """The full name of file ``name`` (a path, a URL), for messages."""

    def sibling(self, name: str) -> CheckpointStorage:
        """The location ``name`` beside this one (in the same parent directory or prefix), with this one's
        settings; ``name`` ``""``: the parent itself. Steps of a managed root reach each other's shards through it
        (cross-step references, docs/format.md 3.4; reading/shard.py checks the root first).

        Raises:
            UnsafePathError: this location has no parent, or the sibling resolves outside it.
            CheckpointError: the medium cannot name siblings.
        """
        raise CheckpointError("this storage medium cannot reach a sibling location (cross-step references "
                              "between the steps of a managed root)", path=self.location)

    # ------------------------------------------------------------------ below this location
    def files_below(self) -> dict[str, int]:
        """Every file of the locations one level below this one (a managed root's steps), ``CHILD/NAME`` -> its
        size in bytes, lock files included; none where nothing is below this location. On an object store, one
        listing (``storage/object_store.py``).

        Raises:
            CheckpointError: the medium cannot list below a location (this default).
        """
        raise CheckpointError("a checkpoint root must be a local directory or an object-store prefix (s3://, az://, "
                              f"gs://): listing the locations below a {type(self).__name__} is not supported",
                              path=self.location)

    def unfinished_below(self) -> list[str]:
        """``CHILD/NAME`` of the writes in progress one level below this location that are no files and that
        removing ``NAME`` from ``CHILD`` clears (an S3 multipart upload a killed save left); by default none."""
        return []

    # ------------------------------------------------------------------ reading
    @abc.abstractmethod
    def exists(self, name: str) -> bool:
        """Whether file ``name`` is there (a regular file; directories are not files here)."""

    @abc.abstractmethod
    def is_location(self) -> bool:
        """Whether the location itself exists (a directory; a prefix with at least one object)."""

    @abc.abstractmethod
    def open_file(self, name: str) -> StoredFile:
        """File ``name``, open for reading.

        Raises:
            IncompleteCheckpointError: there is no such file.
            UnsafePathError: ``name`` leaves the location.
            CheckpointError: it cannot be read (not a regular file, no permission).
        """

    def read_file(self, name: str, limit: int) -> bytes:
        """The whole of a small file (a commit, an index), refused as a FormatError above ``limit`` bytes."""
        with self.open_file(name) as f:
            if f.size > limit:
                raise FormatError(f"file of {f.size} bytes exceeds the limit of {limit}", path=f.path)
            return f.read(0, f.size)  # type: ignore[return-value]  # a bytearray: decoders take either, no copy

    @abc.abstractmethod
    def list(self) -> list[str]:
        """The names of the files at the location (none if it does not exist)."""

    # ------------------------------------------------------------------ the commit
    def find_metadata(self, rank: int | None = None) -> str:
        """The name of the committed metadata file (``.metadata``, or ``__{rank}.metadata``).

        Raises:
            CheckpointNotFoundError: no checkpoint here.
            IncompleteCheckpointError: shard files but no commit (a save that did not finish).
        """
        name = METADATA_NAME if rank is None else f"__{rank}{METADATA_NAME}"
        if self.exists(name):
            self.open_file(name).close()  # a link out of the location is refused, as for shards
            return name
        if not self.is_location():
            raise CheckpointNotFoundError("no checkpoint directory here", path=self.location)
        if rank is not None and self.exists(METADATA_NAME):  # a finished collective save
            raise CheckpointNotFoundError(f"no {name} here: this checkpoint's commit is {METADATA_NAME} (saved with "
                                          "use_collectives=True)", path=self.location)
        if any(n.endswith(".distcp") or ".distcp.tmp-" in n for n in self.list()):
            raise IncompleteCheckpointError(
                f"incomplete checkpoint: shard files but no committed {name} (the save did not finish)",
                path=self.location)
        raise CheckpointNotFoundError(f"no checkpoint here (no {name})", path=self.location)

    def read_metadata(self, name: str = METADATA_NAME) -> CommitFile:
        """The commit file ``name``, read whole (at most ``MAX_METADATA_SIZE`` bytes), with its kind.

        Raises:
            BadMagicError: neither mmapckpt nor stock DCP metadata.
        """
        data = self.read_file(name, MAX_METADATA_SIZE)
        return CommitFile(name, self.full(name), self._kind(name, bytes(data[:8])), data)

    def read_commit(self) -> CommitFile:
        """The committed ``.metadata`` read whole (:meth:`read_metadata` of :meth:`find_metadata`'s name), opened
        once: the open that reads it is the check that it does not leave the location.

        Raises:
            CheckpointNotFoundError: no checkpoint here.
            IncompleteCheckpointError: shard files but no commit (a save that did not finish).
            BadMagicError: neither mmapckpt nor stock DCP metadata.
        """
        if self.exists(METADATA_NAME):
            return self.read_metadata(METADATA_NAME)
        return self.read_metadata(self.find_metadata())  # raises the error that says why it is not there

    def commit_kind(self, name: str = METADATA_NAME) -> str:
        """The kind of commit file ``name`` (``"mmapckpt"`` or ``"dcp"``) from its first bytes, reading no more.

        Raises:
            BadMagicError: neither mmapckpt nor stock DCP metadata.
        """
        with self.open_file(name) as f:
            head = bytes(f.read(0, min(8, f.size)))
        return self._kind(name, head)

    def _kind(self, name: str, head: bytes) -> str:
        kind = metadata_kind(head)
        if kind is None:
            raise BadMagicError("neither mmapckpt nor stock DCP metadata (unknown leading bytes)", path=self.full(name))
        return kind

    # ------------------------------------------------------------------ writing
    @abc.abstractmethod
    def prepare(self) -> None:
        """Make the location ready to be written (create the directory). CheckpointWriteError if it cannot be."""

    @abc.abstractmethod
    def create_file(self, name: str, size: int | None, *, head: int, direct: bool, sync: bool) -> FileOutput:
        """Start writing shard ``name`` of ``size`` bytes (None: not known until the last piece) whose first
        ``head`` bytes come last (:meth:`FileOutput.finish`); ``direct``: bypass the page cache where the medium
        can (a known size only); ``sync``: durable before it is put in place."""

    @abc.abstractmethod
    def commit(self, name: str, data: bytes, *, sync: bool) -> None:
        """Replace file ``name`` by ``data`` atomically: readers see the old file or the whole new one.

        Fenced: while this storage's :meth:`lock` is held, the commit happens only if the lock is
        still held (see :class:`Lock`); a save that lost it gets a CheckpointWriteError and commits nothing.

        Raises:
            CheckpointWriteError: the commit failed or was fenced off (the old file, or another save's, is there).
        """

    @abc.abstractmethod
    def remove(self, names: Iterable[str], *, sync: bool) -> None:
        """Remove these files, ignoring errors (what stays is removed next time)."""

    @abc.abstractmethod
    def lock(self, *, shared: bool = False) -> Lock:
        """Lock the location against a concurrent save (``shared``: the ranks of one per-rank save).

        Raises:
            CheckpointWriteError: another save or conversion holds it (a medium with leased locks first
                waits a bounded time for it, and takes over at once a lock whose holder it can tell is dead).
        """

    @abc.abstractmethod
    def sync(self) -> None:
        """Make the names of files written, renamed or removed durable (CheckpointWriteError if that fails)."""

    # ------------------------------------------------------------------ a new version (conversions)
    def replacement(self, name: str = "", *, owned: Callable[[], Collection[str]] = frozenset,
                    overwrite: bool = True) -> Replacement:
        """A new version of this location's checkpoint (``name`` ""), or of its file ``name``, to be written
        and then put in place by :meth:`Replacement.commit`: old or new at every instant (storage/replacement.py).
        ``owned()`` names the old version's own files, which the new one replaces; no other file is removed.
        ``overwrite`` False: a destination that appears meanwhile is not replaced (CheckpointExistsError).
        The default writes in place (new names, the commit, then the old files removed); a medium with
        renames may write beside the location and swap."""
        from .replacement import InPlace
        return InPlace(self, name, owned)

    def recover(self) -> str | None:
        """Finish or undo a replacement of this location that a killed process left; say what was done
        (None: nothing to do). In-place replacements leave nothing to recover."""
        return None

