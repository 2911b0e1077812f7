"""Files and durability: atomic commits, positional writes and reads, safe paths, mappings.

Nothing here knows the format or torch.distributed; it moves bytes between
buffers and files and keeps them durable.
"""

from __future__ import annotations

import mmap
import os
from typing import Any

from ..errors import CheckpointError, TruncatedFileError, UnsafePathError

__all__ = ["fsync_dir", "atomic_write", "pwrite_all", "pread_into", "map_file", "open_inside", "opened_inside",
           "within", "is_cached", "unlink_quietly", "available_memory", "advise_unlocked", "MADV_POPULATE_WRITE"]

#: ``madvise(MADV_POPULATE_WRITE)``: fault pages in for writing (Linux 5.14; Python's mmap module may not name it)
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


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


def open_inside(directory: str, rel: str, *, links_into: str | None = None) -> str:
    """The real path of ``rel`` inside ``directory``; refuse one that resolves outside (symlinks).

    One exception: where ``links_into`` is given (a directory the caller trusts: the ``blobs/`` of
    the Hugging Face hub cache whose snapshot ``directory`` is, storage/hub.py), a name that stays
    inside ``directory`` may be a link into it. Links anywhere else outside are refused, as is a
    name that itself leaves ``directory`` (``../../blobs/x``).
    """
    root = os.path.realpath(directory)
    full = os.path.realpath(os.path.join(root, rel))
    if within(root, full):
        return full
    blobs = links_into
    if blobs is not None and within(root, os.path.normpath(os.path.join(root, rel))) and within(blobs, full):
        return full
    raise UnsafePathError(f"{rel!r} resolves to {full}, outside the checkpoint directory"
                          + (f" and outside its hub cache's {blobs}" if blobs else ""), path=directory)


def opened_inside(fd: int, directory: str, rel: str, *, links_into: str | None = None) -> None:
    """Check the file open on ``fd`` (opened by a path :func:`open_inside` gave) against the same rule, by
    what the descriptor itself is (``/proc/self/fd``): a link swapped into the path between the check and
    the open is refused, not followed. Where the kernel does not say, the path's check stands."""
    try:
        real = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return
    root = os.path.realpath(directory)
    if within(root, real) or (links_into is not None and within(links_into, real)):
        return
    raise UnsafePathError(f"{rel!r} was opened as {real}, outside the checkpoint directory (a link changed while "
                          "it was opened)", path=directory)


def within(root: str, path: str) -> bool:
    return os.path.commonpath([root, path]) == root


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


_madvise: Any = None  # libc's madvise, looked up on first use (False where there is none)


def _libc_madvise() -> Any:
    global _madvise
    if _madvise is None:
        try:
            import ctypes

            fn = ctypes.CDLL(None, use_errno=True).madvise
            fn.argtypes, fn.restype = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int), ctypes.c_int
            _madvise = fn
        except (OSError, AttributeError, TypeError):  # no C library to load, or no madvise in it
            _madvise = False
    return _madvise


def advise_unlocked(buf: Any, offset: int, length: int, advice: int) -> bool:
    """``madvise(advice)`` of the pages holding ``length`` bytes at ``offset`` of ``buf`` (a writable mapping, or a
    writable memoryview of one), with the GIL released: True if the kernel took it.

    Python's ``mmap.madvise`` holds the GIL for the whole call. Advice that does its work inside the call
    (``MADV_POPULATE_WRITE`` allocates and zeroes every page: 256 MiB took 48 ms here) then stops every other
    thread of the process for as long: a thread counting in a loop meanwhile ran a tenth as often as beside the
    same call made through libc, which ctypes makes with the GIL released. False, having done nothing, where
    libc, the kernel or the advice is missing.
    """
    fn = _libc_madvise()
    if not fn or length <= 0 or offset < 0 or offset + length > memoryview(buf).nbytes:
        return False
    import ctypes

    try:
        anchor = ctypes.c_char.from_buffer(buf, offset)  # byte ``offset``'s address (a buffer export, dropped below)
    except (TypeError, ValueError):  # a read-only buffer
        return False
    address = ctypes.addressof(anchor)
    del anchor
    start = address - address % mmap.PAGESIZE
    return fn(start, address + length - start, advice) == 0


def available_memory() -> int | None:
    """Bytes the page cache could hold now without evicting what a process uses (``MemAvailable`` of
    ``/proc/meminfo``), or None where the kernel does not say (not Linux)."""
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f:
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None
