"""Byte movement: atomic commits, positional writes and reads, mapping files.

Nothing here knows the format or torch.distributed; it moves bytes between
buffers and files and keeps them durable.
"""

from __future__ import annotations

import errno
import mmap
import os
import queue
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NamedTuple

from .errors import CheckpointError, TruncatedFileError, UnsafePathError

__all__ = ["fsync_dir", "atomic_write", "pwrite_all", "pread_into", "map_file", "safe_relative_path", "open_inside",
           "is_cached", "ReadJob", "pread_jobs", "submit_reads", "BLOCK", "open_direct", "DirectWriter"]


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
        _unlink_quietly(tmp)
        raise
    os.close(fd)
    os.replace(tmp, path)
    if sync:
        fsync_dir(d)


def _unlink_quietly(path: str) -> None:
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


def safe_relative_path(rel: str, where: str) -> str:
    """Refuse storage paths that could leave the checkpoint directory."""
    bad = (not rel or "\x00" in rel or os.path.isabs(rel) or rel.startswith(("/", "\\"))
           or any(part in ("..", "") for part in rel.replace("\\", "/").split("/")))
    if bad:
        raise UnsafePathError(f"storage path {rel!r} leaves the checkpoint directory", path=where)
    return rel


def open_inside(directory: str, rel: str) -> str:
    """The real path of ``rel`` inside ``directory``; refuse one that resolves outside (symlinks)."""
    root = os.path.realpath(directory)
    full = os.path.realpath(os.path.join(root, rel))
    if os.path.commonpath([root, full]) != root:
        raise UnsafePathError(f"{rel!r} resolves to {full}, outside the checkpoint directory", path=directory)
    return full


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


class ReadJob(NamedTuple):
    """Read ``len(buf)`` bytes at ``offset`` into ``buf``; ``entry`` names it in errors."""

    buf: Any
    offset: int
    entry: str | None


#: Reads are split into pieces of at most this size, so that threads share long entries.
READ_PIECE = 32 << 20


def pread_jobs(fd: int, jobs: list[ReadJob], *, path: str) -> None:
    """Run every read job in file order on this thread: one sequential stream, which suits a
    cold file (the kernel's readahead sees one pattern). Cached files: :func:`submit_reads`.
    """
    _pread_all(fd, _pieces(jobs), path)


def submit_reads(fd: int, jobs: list[ReadJob], *, threads: int, path: str) -> list[Future[None]]:
    """Start ``jobs`` on the process's reader threads, as ``threads`` runs of about equal bytes.

    One task per run: a task per piece would cost more in hand-offs than thousands of small
    reads take. The caller must wait for every future before it closes ``fd``.
    """
    pieces = _pieces(jobs)
    groups: list[list[ReadJob]] = [[] for _ in range(threads)]
    total, done = sum(_nbytes(p.buf) for p in pieces), 0
    for p in pieces:
        groups[min(threads - 1, done * threads // max(total, 1))].append(p)
        done += _nbytes(p.buf)
    pool = _reader_pool(threads)
    return [pool.submit(_pread_all, fd, g, path) for g in groups if g]


def _pieces(jobs: list[ReadJob]) -> list[ReadJob]:
    """The jobs in file order, long ones split into READ_PIECE pieces so that threads can share them."""
    pieces = []
    for j in sorted(jobs, key=lambda j: j.offset):
        n = _nbytes(j.buf)
        if n <= READ_PIECE:
            pieces.append(j)
            continue
        mv = memoryview(j.buf).cast("B")
        for start in range(0, n, READ_PIECE):
            pieces.append(ReadJob(mv[start:start + READ_PIECE], j.offset + start, j.entry))
    return pieces


_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _reader_pool(threads: int) -> ThreadPoolExecutor:
    """The process's reader threads, started once (starting threads per load cost milliseconds)."""
    global _pool
    with _pool_lock:
        if _pool is None or _pool._max_workers < threads:
            _pool = ThreadPoolExecutor(threads, thread_name_prefix="mmapckpt-pread")
        return _pool


def _forget_pool_after_fork() -> None:
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()  # the child has none of the parent's threads


os.register_at_fork(after_in_child=_forget_pool_after_fork)


def _nbytes(buf: Any) -> int:
    return buf.nbytes if hasattr(buf, "nbytes") else len(memoryview(buf).cast("B"))


def _pread_all(fd: int, pieces: list[ReadJob], path: str) -> None:
    for p in pieces:
        pread_into(fd, p.buf, p.offset, path=path, entry=p.entry)


#: O_DIRECT alignment of file offsets, lengths and memory addresses (covers 512- and 4096-byte devices).
BLOCK = 4096
_REFUSALS = (errno.EINVAL, errno.EOPNOTSUPP, getattr(errno, "ENOTSUP", errno.EOPNOTSUPP))


def _align_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def open_direct(path: str) -> int | None:
    """Create ``path`` for writing with O_DIRECT and probe one aligned write.

    Returns the descriptor, or None where the filesystem refuses O_DIRECT (tmpfs
    refuses the open, some filesystems only the write): the caller then writes buffered.
    """
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return None
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flag, 0o644)
    except OSError as e:
        if e.errno in _REFUSALS:
            return None
        raise
    probe = mmap.mmap(-1, BLOCK)  # anonymous maps are page-aligned
    try:
        os.pwrite(fd, probe, 0)
    except OSError as e:
        os.close(fd)
        if e.errno in _REFUSALS:
            return None
        raise
    finally:
        probe.close()
    return fd


#: Copies into a bounce buffer at least this long go through numpy (which may release the GIL).
_NUMPY_COPY_MIN = 1 << 20


class DirectWriter:
    """Writes a file front to back with O_DIRECT, through page-aligned bounce buffers.

    ``put(offset, data)`` places bytes at ascending offsets (gaps become zeros); a
    writer thread writes each full buffer while the caller fills the next, so the copy
    into the bounce buffer and the caller's checksums overlap the disk. Bytes before
    ``head_size`` (the header region, whose content is known last) are held back until
    ``finish(header, file_size)`` writes them at offset 0; the tail is padded to BLOCK
    and the file then truncated to ``file_size``. The bytes on disk are the same as a
    buffered write of the same puts would leave.
    """

    def __init__(self, fd: int, head_size: int, *, buffer_size: int = 16 << 20, buffers: int = 3) -> None:
        import numpy as np  # only here: the rest of _io needs no numpy

        self._np = np
        self.fd = fd
        self.head_len = max(BLOCK, _align_up(head_size, BLOCK))
        self.head = mmap.mmap(-1, self.head_len)
        self._pool = [mmap.mmap(-1, _align_up(buffer_size, BLOCK)) for _ in range(buffers)]
        self._free: queue.Queue[mmap.mmap] = queue.Queue()
        for b in self._pool:
            self._free.put(b)
        self._jobs: queue.Queue[tuple[mmap.mmap, int, int] | None] = queue.Queue()
        self._error: BaseException | None = None
        self._cur: mmap.mmap | None = None
        self._cur_off, self._fill, self.pos = self.head_len, 0, 0
        self._thread = threading.Thread(target=self._run, name="mmapckpt-odirect", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            buf, off, n = job
            try:
                if self._error is None:
                    pwrite_all(self.fd, memoryview(buf)[:n], off)
            except BaseException as e:  # handed to the caller at its next put or finish
                self._error = e
            self._free.put(buf)

    def _check(self) -> None:
        if self._error is not None:
            raise self._error

    def put(self, offset: int, data: Any) -> None:
        """Place ``data`` at ``offset`` (not before the end of the previous put)."""
        if offset < self.pos:
            raise ValueError(f"DirectWriter: offset {offset} is before the current end {self.pos}")
        if offset > self.pos:
            self._copy(memoryview(bytes(offset - self.pos)))
        self._copy(memoryview(data).cast("B"))

    def _copy(self, src: memoryview) -> None:
        np, i = self._np, 0
        if self.pos < self.head_len and len(src):
            i = min(len(src), self.head_len - self.pos)
            self.head[self.pos:self.pos + i] = src[:i]
            self.pos += i
        while i < len(src):
            if self._cur is None:
                self._cur = self._free.get()
                self._check()
            n = min(len(src) - i, len(self._cur) - self._fill)
            if n < _NUMPY_COPY_MIN:  # a memoryview slice assignment is one memcpy, without numpy's set-up
                memoryview(self._cur)[self._fill:self._fill + n] = src[i:i + n]
            else:
                np.frombuffer(self._cur, np.uint8)[self._fill:self._fill + n] = np.frombuffer(src[i:i + n], np.uint8)
            i, self._fill, self.pos = i + n, self._fill + n, self.pos + n
            if self._fill == len(self._cur):
                self._submit(len(self._cur))

    def _submit(self, n: int) -> None:
        assert self._cur is not None  # internal invariant, not file content
        self._jobs.put((self._cur, self._cur_off, n))
        self._cur_off += len(self._cur)
        self._cur, self._fill = None, 0

    def finish(self, header: bytes, file_size: int) -> None:
        """Write the held-back tail and head (``header`` at offset 0), then size the file."""
        try:
            if self._cur is not None and self._fill:
                end = _align_up(self._fill, BLOCK)
                self._cur[self._fill:end] = bytes(end - self._fill)
                self._submit(end)
        finally:
            self._jobs.put(None)
            self._thread.join()
        self._check()
        if len(header) > self.head_len:
            raise ValueError(f"header of {len(header)} bytes does not fit the {self.head_len}-byte head")
        self.head[:len(header)] = header
        pwrite_all(self.fd, self.head, 0)
        os.ftruncate(self.fd, file_size)

    def close(self) -> None:
        """Stop the writer thread (if finish was not reached) and free the buffers."""
        if self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join()
        for b in (*self._pool, self.head):
            b.close()
