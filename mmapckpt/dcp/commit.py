"""A save over an existing checkpoint: old or new at every instant, never neither.

The one commit point is the atomic, fsynced rename of the new metadata file over the
old one (``.metadata``, or ``__{rank}.metadata`` for a save with use_collectives=False).
Until then the old commit and every file it names stay untouched: new shard files never
take the name of a shard file in the directory (:func:`shard_name`), so never one a commit
references. Only after
the new commit is durable are the files that no commit references any more removed
(:func:`remove_stale`): the old checkpoint's shards, and the leftovers of killed saves.

Removing leftovers is safe only while no other save writes into the directory, so a save
holds :class:`SaveLock` (an exclusive ``flock`` on the directory) from planning to
commit: a second save into the same directory at the same time, or a ``convert --overwrite``
of it (which holds the same lock while it writes and swaps), gets a CheckpointWriteError.
The kernel drops the lock when its process dies, so a killed save never blocks the next.
"""

from __future__ import annotations

import fcntl
import gc
import glob
import os
import re

from ..errors import CheckpointError, CheckpointWriteError
from ..format.metadata import METADATA_NAME, read_index_file
from ..io.files import atomic_write, fsync_dir

__all__ = ["SHARD_SUFFIX", "SaveLock", "metadata_path", "commit_files", "committed_files",
           "existing_shards", "shard_name", "commit", "remove_stale", "writable_local_path"]

SHARD_SUFFIX = ".distcp"
#: Files of a DCP checkpoint's own making, the only ones a save ever removes.
_SHARD = re.compile(r"__\d+_\d+(\.[0-9a-f]{8})?\.distcp\Z")
_RANK_COMMIT = re.compile(r"__\d+\.metadata\Z")
_TEMP = re.compile(r"\.(__\d+_\d+(\.[0-9a-f]{8})?\.distcp|(__\d+)?\.metadata)\.tmp-[0-9a-z]+\Z")


class SaveLock:
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


def metadata_path(path: str, rank: int | None) -> str:
    """The commit file: ``.metadata``, or ``__{rank}.metadata`` for a save with use_collectives=False."""
    name = METADATA_NAME if rank is None else f"__{rank}{METADATA_NAME}"
    return os.path.join(path, name)


def commit_files(path: str) -> list[str]:
    """Every commit in the directory: ``.metadata`` and the per-rank ``__{rank}.metadata`` files."""
    found = glob.glob(os.path.join(glob.escape(path), f"__*{METADATA_NAME}"))
    found = [p for p in found if _RANK_COMMIT.match(os.path.basename(p))]
    main = os.path.join(path, METADATA_NAME)
    return ([main] if os.path.isfile(main) else []) + sorted(found)


def committed_files(path: str, commits: list[str]) -> set[str]:
    """The file names the commit files ``commits`` (in directory ``path``) reference.

    A commit that cannot be read counts as referencing every shard file there: nothing it
    might name is ever reused or removed because of it.
    """
    names: set[str] = set()
    for meta in commits:
        try:
            _, entries, _ = read_index_file(meta)
        except (CheckpointError, OSError):
            names.update(n for n in _listdir(path) if n.endswith(SHARD_SUFFIX))
            continue
        names.update(c.file for e in entries.values() for c in e.chunks)
    return names


def existing_shards(path: str) -> set[str]:
    """The shard files in the directory: whatever a commit there may reference (new shards avoid them all).

    Listing the directory, rather than decoding the old metadata, keeps the cost per save
    independent of the old checkpoint's entry count.
    """
    return {n for n in _listdir(path) if n.endswith(SHARD_SUFFIX)}


def shard_name(prefix: str, k: int, save_id: str, avoid: frozenset[str] | set[str]) -> str:
    """``{prefix}{k}.distcp`` (DCP's own name), or with the save id in it where that name is taken."""
    name = f"{prefix}{k}{SHARD_SUFFIX}"
    if name in avoid:
        name = f"{prefix}{k}.{save_id.replace('-', '')[:8]}{SHARD_SUFFIX}"
    if name in avoid:  # cannot happen for a fresh save id; refuse rather than overwrite a committed file
        raise CheckpointWriteError("no free shard file name (both candidates exist)", path=name)
    return name


def commit(target: str, data: bytes, *, sync: bool) -> None:
    """The commit point: ``data`` replaces ``target`` atomically (temp file, fsync, rename, fsync of the directory)."""
    try:
        atomic_write(target, data, sync=sync)
    except OSError as e:
        raise CheckpointWriteError(f"committing the metadata failed: {e}", path=target) from e


def remove_stale(path: str, *, keep_commit: str, keep_files: set[str], rank_prefix: str | None, sync: bool) -> None:
    """After a durable commit: remove what no commit references any more.

    ``keep_commit`` is the commit just written and ``keep_files`` the files it references.
    A collective save (``rank_prefix`` None)
    removes the per-rank commits of an earlier use_collectives=False save, then every shard
    and temporary file of DCP's making that ``.metadata`` does not reference. A per-rank save
    removes ``.metadata`` (an earlier collective save's commit, which would otherwise load as
    a checkpoint older than this rank's), then only its own rank's unreferenced shards and
    temporary files: other ranks may still be writing theirs. Files of other names (notes,
    configs) are never touched. Errors are ignored: what stays is removed next time.
    """
    names = _listdir(path)
    if rank_prefix is None:
        doomed = [n for n in names if _RANK_COMMIT.match(n)]
    else:
        doomed = [METADATA_NAME] if METADATA_NAME in names else []
    for n in doomed:
        _unlink(os.path.join(path, n))
    keep = set(keep_files)
    if rank_prefix is not None:  # the other ranks' commits still name their files
        keep |= committed_files(path, [p for p in commit_files(path) if p != keep_commit])
    own = () if rank_prefix is None else (rank_prefix, f"{rank_prefix[:-1]}{METADATA_NAME}.tmp-")
    mine = (lambda n: True) if rank_prefix is None else (lambda n: n.lstrip(".").startswith(own))
    for n in names:
        if n not in keep and (_SHARD.match(n) or _TEMP.match(n)) and mine(n):
            _unlink(os.path.join(path, n))
    if sync:
        try:
            fsync_dir(path)
        except OSError:
            pass


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


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def _unlink(p: str) -> None:
    try:
        os.unlink(p)
    except OSError:
        pass
