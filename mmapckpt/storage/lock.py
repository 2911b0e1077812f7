"""The save lock of a local checkpoint directory: an exclusive ``flock`` on the directory itself.

Removing the leftovers of earlier saves is safe only while no other save writes into the
directory, so a save holds :class:`SaveLock` from planning to commit: a second save into the
same directory at the same time, or a ``convert --overwrite`` of it (which holds the same lock
while it writes and swaps), gets a CheckpointWriteError. The kernel drops the lock when its
process dies, so a killed save never blocks the next.
"""

from __future__ import annotations

import fcntl
import gc
import os

from ..errors import CheckpointWriteError
from .base import Lock

__all__ = ["SaveLock"]


class SaveLock(Lock):
    """A ``flock`` on the checkpoint directory itself, held for one save (no lock file is left behind).

    A collective save takes it exclusively; a per-rank save (use_collectives=False) shared,
    so that the ranks of one such save do not exclude one another. ``convert --overwrite``
    takes it exclusively too, on the directory it replaces and on the one it puts there.
    Raises CheckpointWriteError at once if another save or conversion (in any process, this
    one included) holds it in a conflicting mode. The lock is on the directory's inode: where
    the path came to name another directory between the open and the lock (a conversion
    swapped it in), the directory now at the path is locked instead. Where the filesystem
    has no flock for directories (some network filesystems), saves go unlocked.
    """

    def __init__(self, directory: str, *, shared: bool = False) -> None:
        self._fd: int | None = None
        for _ in range(_LOCK_ATTEMPTS):
            fd = _open_dir(directory)
            self._fd = fd
            if not _flock(fd, shared, directory, self):
                return  # no flock here: nothing to hold
            if _same_inode(fd, directory):
                return
            self.release()  # swapped out while we locked it: lock the directory the path names now
        raise CheckpointWriteError("the directory was replaced again and again while its lock was taken; "
                                   "retry the save", path=directory)

    def release(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)  # closing the descriptor drops the flock

    def __del__(self) -> None:
        self.release()


_LOCK_ATTEMPTS = 5


def _open_dir(directory: str) -> int:
    try:
        return os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise CheckpointWriteError(f"cannot open the checkpoint directory: {e}", path=directory) from e


def _flock(fd: int, shared: bool, directory: str, lock: SaveLock) -> bool:
    """Lock ``fd``; False where the filesystem has no flock (``lock`` released); raise if it is held."""
    mode = (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB
    try:
        try:
            fcntl.flock(fd, mode)
        except BlockingIOError:
            # A save of this process that failed on another rank never reached finish(): its
            # writer may be garbage that still holds the lock (DCP's exceptions form cycles).
            gc.collect()
            fcntl.flock(fd, mode)
    except BlockingIOError:
        lock.release()
        raise CheckpointWriteError(
            "another save or conversion into this directory is in progress (it holds the directory's lock); "
            "wait for it to finish, or write elsewhere", path=directory) from None
    except OSError:
        lock.release()
        return False
    return True


def _same_inode(fd: int, directory: str) -> bool:
    """Whether ``directory`` still names the directory open as ``fd``."""
    a = os.fstat(fd)
    try:
        b = os.stat(directory)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)
