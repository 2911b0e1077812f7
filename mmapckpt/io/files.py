"""Files and durability: atomic commits, positional writes and reads, safe paths, mappings.

Nothing here knows the format or torch.distributed; it moves bytes between
buffers and files and keeps them durable.
"""

from __future__ import annotations

import mmap
import os
import re
from typing import Any

from ..errors import CheckpointError, CheckpointNotFoundError, TruncatedFileError, UnsafePathError

__all__ = ["fsync_dir", "atomic_write", "pwrite_all", "pread_into", "map_file", "open_inside",
           "hub_blobs", "hub_snapshot", "is_cached", "unlink_quietly", "refuse_url"]


def fsync_dir(path: str) -> None:
    """Make a directory's entries (new, renamed or removed files) durable."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str, data: bytes, *, sync: bool = True) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the whole new one.

    temp file in the same directory -> write -> fsync -> rename -> fsync of the directory.
    """
    d = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(d, f".{os.path.basename(path)}.tmp-{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        pwrite_all(fd, memoryview(data), 0)
        if sync:
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        unlink_quietly(tmp)
        raise
    os.close(fd)
    os.replace(tmp, path)
    if sync:
        fsync_dir(d)


def unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def pwrite_all(fd: int, buf: Any, offset: int) -> None:
    """``os.pwrite`` until every byte of ``buf`` is written (short writes happen)."""
    mv = memoryview(buf).cast("B")
    while len(mv):
        n = os.pwrite(fd, mv, offset)
        if n <= 0:
            raise OSError(f"pwrite wrote {n} bytes at offset {offset}")
        mv, offset = mv[n:], offset + n


def pread_into(fd: int, buf: Any, offset: int, *, path: str, entry: str | None = None) -> None:
    """Fill ``buf`` from ``fd`` at ``offset``; a short file raises TruncatedFileError."""
    mv = memoryview(buf).cast("B")
    while len(mv):
        n = os.preadv(fd, [mv], offset)
        if n <= 0:
            raise TruncatedFileError(f"file ended at offset {offset} while reading", path=path, entry=entry)
        mv, offset = mv[n:], offset + n


def refuse_url(path: str, error: type[CheckpointError]) -> None:
    """Raise ``error`` for a URL (``s3://bucket/ckpt``), which would otherwise become a local directory ``s3:``."""
    if "://" in path:
        raise error(f"{path!r} is a URL: mmapckpt reads and writes a local or mounted file system. Copy the "
                    "checkpoint to a local disk, or mount the storage (s3fs, gcsfuse, NFS) and pass that path",
                    path=path)


def open_inside(directory: str, rel: str) -> str:
    """The real path of ``rel`` inside ``directory``; refuse one that resolves outside (symlinks).

    One exception: in a snapshot of a Hugging Face hub cache (:func:`hub_blobs`), a name that
    stays inside ``directory`` may be a link into that repository's ``blobs/``, as the hub lays
    them out. Links anywhere else outside (another repository's blobs, ``refs/``, out of the
    cache) are refused, as is a name that itself leaves ``directory`` (``../../blobs/x``).
    """
    root = os.path.realpath(directory)
    full = os.path.realpath(os.path.join(root, rel))
    if _within(root, full):
        return full
    blobs = hub_blobs(root)
    if blobs is not None and _within(root, os.path.normpath(os.path.join(root, rel))) and _within(blobs, full):
        return full
    raise UnsafePathError(f"{rel!r} resolves to {full}, outside the checkpoint directory"
                          + (f" and outside its hub cache's {blobs}" if blobs else ""), path=directory)


def _within(root: str, path: str) -> bool:
    return os.path.commonpath([root, path]) == root


#: A repository of a Hugging Face hub cache: models--ORG--NAME (also datasets--, spaces--).
_HUB_REPO = re.compile(r"(?:models|datasets|spaces)--.+")


def hub_blobs(root: str) -> str | None:
    """The ``blobs/`` of the Hugging Face hub cache repository whose snapshot holds ``root`` (a real path), or None.

    ``snapshot_download`` lays a repository out as ``models--ORG--NAME/{blobs/HASH, refs/,
    snapshots/REV/...}``, each snapshot file a relative link ``../../blobs/HASH``. ``root`` is
    ``snapshots/REV`` or a directory below it. A file counts as in ``blobs`` by its real path,
    so a ``blobs`` that is itself a link to elsewhere admits nothing.
    """
    p = root
    while True:
        parent = os.path.dirname(p)
        if parent == p:
            return None
        if os.path.basename(parent) == "snapshots":
            repo = os.path.dirname(parent)
            blobs = os.path.join(repo, "blobs")
            return blobs if _HUB_REPO.fullmatch(os.path.basename(repo)) and os.path.isdir(blobs) else None
        p = parent


#: A revision as refs/ files hold it (a commit hash; a name only, never a path).
_HUB_REVISION = re.compile(r"[0-9A-Za-z][0-9A-Za-z._-]{0,254}")


def hub_snapshot(repo: str) -> str | None:
    """The snapshot ``refs/main`` names, where ``repo`` is the root of a repository of a Hugging Face hub cache
    (``models--ORG--NAME`` holding ``snapshots/``); None for any other directory.

    Raises:
        CheckpointNotFoundError: a hub repository whose ``refs/main`` is missing, holds no revision name, or
            names a snapshot that is not there (or not inside ``snapshots/``).
    """
    snapshots = os.path.join(repo, "snapshots")
    if not _HUB_REPO.fullmatch(os.path.basename(os.path.normpath(repo))) or not os.path.isdir(snapshots):
        return None
    have = sorted(os.listdir(snapshots))
    fix = f"name a snapshot directory instead ({os.path.join(repo, 'snapshots', 'REV')}; here: {have or 'none'})"
    ref = os.path.join(repo, "refs", "main")
    try:
        with open(ref, "rb") as f:
            rev = f.read(256).decode("ascii").strip()
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointNotFoundError(f"hub cache repository without a readable refs/main ({e}): {fix}",
                                      path=repo) from None
    snap = os.path.join(snapshots, rev)
    if not _HUB_REVISION.fullmatch(rev) or not os.path.isdir(snap) or \
            not _within(os.path.realpath(snapshots), os.path.realpath(snap)):
        raise CheckpointNotFoundError(f"hub cache refs/main names revision {rev[:80]!r}, which has no snapshot "
                                      f"here: {fix}", path=repo)
    return snap


def map_file(path: str, size: int) -> mmap.mmap | None:
    """Map ``size`` bytes of ``path`` copy-on-write (MAP_PRIVATE, readable and writable).

    Writable private pages let torch build ordinary tensors over them: writing to
    one copies that page and never changes the file. Returns None for ``size`` 0.
    """
    if size == 0:
        return None
    try:
        with open(path, "rb") as f:
            return mmap.mmap(f.fileno(), size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot map file: {e}", path=path) from e


def is_cached(fd: int, offsets: list[int]) -> bool:
    """Whether the bytes at ``offsets`` are all in the page cache (a probe that starts no I/O wait).

    Each probe is a one-byte ``preadv`` with RWF_NOWAIT, which fails with EAGAIN instead of
    waiting for the disk. Where the flag is unsupported the file counts as not cached.
    """
    flag = getattr(os, "RWF_NOWAIT", None)
    if flag is None:
        return False
    probe = bytearray(1)
    for off in offsets:
        try:
            if os.preadv(fd, [probe], off, flag) != 1:
                return False
        except OSError:  # EAGAIN: not cached; EOPNOTSUPP/EINVAL: cannot tell
            return False
    return True
