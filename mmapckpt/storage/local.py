"""A checkpoint in a local (or mounted) directory: files mapped, read with ``preadv``, written with O_DIRECT.

- Reading: :class:`LocalFile` opens a regular file once (a FIFO or a device is refused) and
  keeps that descriptor: the mapping (MAP_PRIVATE, made on first use) and every ``preadv``
  are of the same inode, even if the path is renamed over meanwhile.
- Writing: :class:`LocalOutput` writes a shard under a temporary name (``.NAME.tmp-XXXX``),
  through page-aligned O_DIRECT bounce buffers where the filesystem takes them and
  positional writes where it does not, its head last; then fsync and rename into place, so
  a new inode replaces the old file and readers that mapped the old one keep valid pages.
- The commit is a temporary file, fsync, rename over the old one, fsync of the directory.
- A new version of a whole checkpoint or file (a conversion: :class:`Swap`) is written beside
  the old one under a temporary name and swapped in by one exchange (storage/replace.py), its
  journal finished or undone by the next conversion's :meth:`LocalStorage.recover`.
- Names are resolved inside the directory (symlinks out of it are refused, except into the
  ``blobs/`` of a Hugging Face hub cache snapshot: storage/hub.py ``hub_blobs``).
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from ..errors import CheckpointError, CheckpointExistsError, CheckpointWriteError, TruncatedFileError, UnsafePathError
from ..io.files import atomic_write, fsync_dir, open_inside, opened_inside, pread_into, pwrite_all, unlink_quietly
from .hub import hub_blobs
from ..io.mapped import MappedFile, open_regular
from .base import CheckpointStorage, FileOutput, Lock, StoredFile
from .replacement import Owned, Replacement

if TYPE_CHECKING:  # the write side (O_DIRECT writers, the save lock, the swap and its journal) is imported by the
    from ..io.odirect import DirectWriter  # writes and conversions that use it: a load imports none of it

__all__ = ["LocalStorage", "LocalFile", "LocalOutput", "Swap", "writable_local_path"]


class LocalFile(StoredFile):

    fd = -1  # until opened
    """A regular file opened read-only; its descriptor serves every read and the mapping.

    Attributes:
        fd: the descriptor (closed by :meth:`close`; -1 after).
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = open_regular(path)
        try:
            st = os.fstat(self.fd)
        except OSError as e:
            os.close(self.fd)
            raise CheckpointError(f"cannot read file: {e.strerror}", path=path) from None
        self.size, self.ident = st.st_size, (st.st_dev, st.st_ino)
        self._mapping: MappedFile | None = None

    def read_into(self, offset: int, buf: Any, *, entry: str | None = None) -> None:
        if self.fd < 0:
            raise ValueError(f"read of a closed file ({self.path})")
        try:
            pread_into(self.fd, buf, offset, path=self.path, entry=entry)
        except OSError as e:
            raise CheckpointError(f"cannot read file: {e.strerror or e}", path=self.path, entry=entry) from None

    @property
    def mapping(self) -> MappedFile:
        """The file's first :attr:`size` bytes mapped MAP_PRIVATE (made on first use; outlives :meth:`close`)."""
        if self._mapping is None:
            if self.fd < 0:
                raise ValueError(f"mapping of a closed file ({self.path})")
            self._mapping = MappedFile(self.fd, self.path, self.size)
        return self._mapping

    def check_unchanged(self) -> None:
        if self._mapping is not None:
            self._mapping.check_unchanged()
        elif self.fd >= 0 and os.fstat(self.fd).st_size < self.size:
            raise TruncatedFileError(f"file shrank from {self.size} bytes while it was being read", path=self.path)

    def close(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)

    def __del__(self) -> None:
        self.close()


class LocalOutput(FileOutput):
    """A shard written under a temporary name, then renamed to ``path`` by :meth:`finish`."""

    def __init__(self, path: str, size: int | None, *, head: int, direct: bool, sync: bool) -> None:
        self.path, self.size, self.sync = path, size, sync
        d, name = os.path.split(path)
        self.tmp = os.path.join(d, f".{name}.tmp-{uuid.uuid4().hex[:12]}")
        from ..io.odirect import DirectWriter, open_direct

        fd = open_direct(self.tmp) if direct and size is not None else None
        self.how = "buffered" if fd is None else "direct"
        if fd is None:
            fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self.fd: int = fd
        self._direct: DirectWriter | None = None
        try:
            if size is not None:
                os.ftruncate(fd, size)
            if self.how == "direct":
                self._direct = DirectWriter(fd, head)
        except BaseException:
            self.abort()
            raise

    def put(self, offset: int, data: Any) -> None:
        if self._direct is not None:
            self._direct.put(offset, data)
        elif len(memoryview(data)):
            pwrite_all(self.fd, data, offset)

    def shrink(self, size: int) -> None:
        self.size = size
        if self._direct is None:  # O_DIRECT output is cut to its size by its finish
            os.ftruncate(self.fd, size)

    def finish(self, head: bytes) -> None:
        if self._direct is not None:
            self._direct.finish(head, self.size)  # type: ignore[arg-type]
            self._direct.close()
            self._direct = None
        else:
            pwrite_all(self.fd, head, 0)
        if self.sync:
            os.fsync(self.fd)
        fd, self.fd = self.fd, -1
        os.close(fd)
        os.replace(self.tmp, self.path)

    def abort(self) -> None:
        if self._direct is not None:
            self._direct.close()
            self._direct = None
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)
        unlink_quietly(self.tmp)


class LocalStorage(CheckpointStorage):
    """A checkpoint directory on a local or mounted filesystem (see the module docstring)."""

    can_map = True

    def __init__(self, location: str | os.PathLike[str]) -> None:
        self.location = os.fspath(location)

    def full(self, name: str) -> str:
        return os.path.join(self.location, name)

    def sibling(self, name: str) -> LocalStorage:
        here = os.path.abspath(self.location)
        parent = os.path.dirname(here)
        if parent == here or (name and (os.sep in name or name in (".", ".."))):
            raise UnsafePathError(f"no sibling {name!r} of this directory", path=self.location)
        if not name:
            return LocalStorage(parent)
        there = os.path.join(parent, name)
        # the step directory itself (a link elsewhere, even to inside the root, would pair names and bytes
        # of different places): it must be a directory of the parent, as found
        if os.path.islink(there) or os.path.dirname(os.path.realpath(there)) != os.path.realpath(parent):
            raise UnsafePathError(f"sibling {name!r} is a link or resolves outside {parent}", path=there)
        return LocalStorage(there)

    def exists(self, name: str) -> bool:
        return os.path.isfile(os.path.join(self.location, name))

    def is_location(self) -> bool:
        return os.path.isdir(self.location)

    def open_file(self, name: str) -> LocalFile:
        blobs = hub_blobs(os.path.realpath(self.location))
        f = LocalFile(open_inside(self.location, name, links_into=blobs))
        try:
            opened_inside(f.fd, self.location, name, links_into=blobs)  # the file opened, not only its path
        except BaseException:
            f.close()
            raise
        return f

    def list(self) -> list[str]:
        try:
            return os.listdir(self.location)
        except OSError:
            return []

    def prepare(self) -> None:
        try:
            os.makedirs(self.location, exist_ok=True)
        except OSError as e:
            raise CheckpointWriteError(f"cannot create the checkpoint directory: {e}", path=self.location) from e

    def create_file(self, name: str, size: int | None, *, head: int, direct: bool, sync: bool) -> LocalOutput:
        return LocalOutput(os.path.join(self.location, name), size, head=head, direct=direct, sync=sync)

    def commit(self, name: str, data: bytes, *, sync: bool) -> None:
        target = os.path.join(self.location, name)
        try:
            atomic_write(target, data, sync=sync)
        except OSError as e:
            raise CheckpointWriteError(f"committing the metadata failed: {e}", path=target) from e

    def remove(self, names: Iterable[str], *, sync: bool) -> None:
        for n in names:
            unlink_quietly(os.path.join(self.location, n))
        if sync:
            try:
                self.sync()
            except CheckpointWriteError:
                pass

    def lock(self, *, shared: bool = False) -> Lock:
        from .lock import SaveLock

        return SaveLock(self.location, shared=shared)

    def sync(self) -> None:
        try:
            fsync_dir(self.location)
        except OSError as e:
            raise CheckpointWriteError(f"syncing the checkpoint directory failed: {e}", path=self.location) from e

    def replacement(self, name: str = "", *, owned: Owned = frozenset, overwrite: bool = True) -> Swap:
        return Swap(self.location, name, owned, overwrite)

    def recover(self) -> str | None:
        """Finish or undo an interrupted replacement of this path (storage/replace.py ``recover``), and remove
        the temporary files of conversions whose process is gone, beside it."""
        from . import replace

        parent = os.path.dirname(os.path.abspath(self.location))
        try:
            done = replace.recover(self.location)
            if os.path.isdir(parent):
                replace.remove_stale_temps(self.location)
                replace.remove_dead_temps(parent)  # a killed conversion to another name here left its output
        except CheckpointError:
            raise
        except OSError as e:
            raise CheckpointWriteError(f"cannot look for an interrupted conversion beside it ({e.strerror or e}): "
                                       f"a conversion needs permission to list and write {parent}",
                                       path=self.location) from e
        return done


class Swap(Replacement):
    """A new version of a local directory or file, written beside it and swapped in (storage/replacement.py).

    A directory output is written into a new temporary directory ``.NAME.tmp-...`` beside the
    destination, a file output as the temporary file of that name; :meth:`commit` locks the new
    directory (no save slips in before the conversion is done) and puts it at the destination with
    storage/replace.py ``replace_path``: the old version's own files (``owned()``) are replaced,
    every other entry of an old directory is carried over. The lock is held until :meth:`close`.
    """

    def __init__(self, location: str, name: str, owned: Owned, overwrite: bool) -> None:
        super().__init__()
        from . import replace

        self.target = os.path.join(location, name) if name else location
        self._owned, self._overwrite, self._lock = owned, overwrite, None
        self._tmp = replace.temp_sibling(self.target)
        self.avoid = frozenset()
        if name:
            self.storage, self.name = LocalStorage(location), os.path.basename(self._tmp)
        else:
            self.storage, self.name = LocalStorage(self._tmp), ""
            os.mkdir(self._tmp)

    def commit(self, commit: str) -> list[str]:
        if os.path.lexists(self.target) and not self._overwrite:
            raise CheckpointExistsError("destination appeared during the conversion", path=self.target)
        from . import replace

        if not self.name:
            self.storage.sync()
            self._lock = self.storage.lock()  # the new directory is locked before it is swapped in
        owned: list[str] = []
        if os.path.isdir(self.target) and not os.path.islink(self.target):
            owned = [n for n in self._owned() if os.path.islink(os.path.join(self.target, n))
                     or not os.path.isdir(os.path.join(self.target, n))]  # never a subdirectory
        try:
            return replace.replace_path(self._tmp, self.target, owned=owned)
        except FileExistsError as e:
            raise CheckpointExistsError("destination appeared during the conversion", path=self.target) from e

    def scratch(self) -> str:
        return f"{self._tmp}.scratch-{uuid.uuid4().hex[:8]}"  # a temp sibling's name: removed once its writer is gone

    def abort(self) -> None:
        from . import replace

        try:  # undo or finish a swap already under way, else drop the unfinished new version
            if replace.recover(self.target) is None and os.path.lexists(self._tmp):
                if os.path.isdir(self._tmp) and not os.path.islink(self._tmp):
                    shutil.rmtree(self._tmp, ignore_errors=True)
                else:
                    os.unlink(self._tmp)
        except OSError:
            pass  # the journal stays: the next conversion here recovers

    def close(self) -> None:
        lock, self._lock = self._lock, None
        if lock is not None:
            lock.release()


def writable_local_path(s: str) -> bool:
    """Whether ``s`` names a local path whose nearest existing directory is writable (no URL)."""
    if "://" in s:
        return False
    p = os.path.abspath(s)
    while True:
        if os.path.isdir(p):
            return os.access(p, os.W_OK)
        parent = os.path.dirname(p)
        if parent == p:
            return False
        p = parent
