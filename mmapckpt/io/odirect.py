"""O_DIRECT writes: a probe for whether the filesystem takes them, and a front-to-back writer."""

from __future__ import annotations

import errno
import mmap
import os
import queue
import threading
from typing import Any

from .files import pwrite_all

__all__ = ["BLOCK", "BUFFER_SIZE", "open_direct", "DirectWriter", "take_buffer", "give_back", "release_buffers"]


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

#: Bounce buffers kept for the next save: a fresh anonymous buffer costs a page fault per 4 KiB on
#: first touch (16 MB copied into new pages took 13-25 ms on the development VM, into reused ones
#: 1.2 ms), which was most of a small save's time. At most _KEEP of them (48 MiB by default).
_spare: list[mmap.mmap] = []
_spare_lock = threading.Lock()
_KEEP = 12
#: The bounce buffers of a writer: the disk gets the first buffer's bytes once they are copied
#: and checksummed, while the next are filled, so a small file's write overlaps its copies too
#: (4 MiB O_DIRECT writes ran as fast as 16 MiB ones here: 1.95 and 1.82 GB/s, 256 MB).
BUFFER_SIZE = 4 << 20
BUFFERS = 12


def take_buffer(size: int) -> mmap.mmap:
    with _spare_lock:
        for i, b in enumerate(_spare):
            if len(b) == size:
                return _spare.pop(i)
    return mmap.mmap(-1, size)


def give_back(buf: mmap.mmap) -> None:
    with _spare_lock:
        if len(_spare) < _KEEP:
            _spare.append(buf)
            return
    buf.close()


def release_buffers() -> None:
    """Free the bounce buffers the O_DIRECT writer keeps between saves (they are made anew when needed)."""
    with _spare_lock:
        spare, _spare[:] = list(_spare), []
    for b in spare:
        b.close()


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

    def __init__(self, fd: int, head_size: int, *, buffer_size: int = BUFFER_SIZE, buffers: int = BUFFERS) -> None:
        import numpy as np  # only here: the rest of _io needs no numpy

        self._np = np
        self.fd = fd
        self.head_len = max(BLOCK, _align_up(head_size, BLOCK))
        self.head = mmap.mmap(-1, self.head_len)
        self._pool = [take_buffer(_align_up(buffer_size, BLOCK)) for _ in range(buffers)]
        self._finished = False  # then no view of the buffers is left, and they can serve the next save
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
                # without its traceback: the frames hold views of the buffer, which close() must free
                self._error = e.with_traceback(None)
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
        self._finished = True

    def close(self) -> None:
        """Stop the writer thread (if finish was not reached) and free the buffers."""
        if self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join()
        pool, self._pool = self._pool, []
        if self._finished:
            for b in pool:
                give_back(b)
            pool = []
        for b in (*pool, self.head):
            try:
                b.close()
            except BufferError:  # a view still exported (an error's frames): freed with the last view
                pass
