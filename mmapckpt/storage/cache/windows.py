"""The buffers a fetch into the cache reads its windows into, writes the copy from, and serves the load from.

A fetch (entry.py ``fill``) brings a file in by windows of ``window`` bytes at aligned offsets. Each
window's bytes are read into a buffer of its own (anonymous memory, page-aligned, reused from one
window to the next), checked there, then written into the copy with ``O_DIRECT``: the copy's bytes go
to the disk without passing through new page-cache pages. Filling 1 GB of new page-cache pages cost
the first load 0.3-1.0 CPU-s here (the pages' first touch: a zeroing pass and the bytes' own, on a VM
whose free memory goes back to the host), which an ``O_DIRECT`` write of reused buffers does not
pay. Where the file system refuses ``O_DIRECT`` (tmpfs, some FUSE mounts) the windows are written
with ``pwrite`` instead, through the page cache.

The load that waits for the fetch (filling.py) reads right behind it: a window stays in its buffer
once written, and the load's reads of it copy from there (:meth:`Windows.read`). A buffer is taken
back for a new window only when no read is copying from it, oldest window first; a read of a window
no longer held reads the copy (``preadv``), the bytes being on disk by then. ``ahead + keep`` buffers
in all: at most ``ahead`` being fetched, the rest holding the last windows written.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import threading
from typing import Any

from ...io.files import pread_into, pwrite_all
from ...io.odirect import BLOCK

__all__ = ["Windows"]

_REFUSALS = (errno.EINVAL, errno.EOPNOTSUPP, getattr(errno, "ENOTSUP", errno.EOPNOTSUPP))


class Windows:
    """Window buffers of the copy ``path`` being fetched (``size`` bytes, open for writing as ``fd``): the
    windows ``[k * window, (k + 1) * window)``, up to ``count`` buffers (module docstring). ``window`` is a
    multiple of :data:`BLOCK`."""

    def __init__(self, path: str, fd: int, size: int, window: int, count: int) -> None:
        self.path, self.fd, self.size, self.window = path, fd, size, window
        self.count = max(1, min(count, -(-size // window)))
        self._room = min(window, -(-size // BLOCK) * BLOCK) or BLOCK  # one buffer's bytes (a small file: its own)
        self._cond = threading.Condition()
        self._memory: mmap.mmap | None = None  # made on the first window (its pages touched as they are used)
        self._base = 0
        self._free = list(range(self.count))  # buffer slots not holding a window
        self._held: dict[int, int] = {}  # window -> slot, for windows written (the load reads them there)
        self._readers = [0] * self.count  # reads copying out of each slot now
        self._reading = 0  # reads in progress (the buffers are released once there are none)
        self._released = False
        #: bytes the load read from the copy, their window no longer held
        self.read_back = 0
        self._head = b""  # the file's first bytes, served from here until their window is written
        self._direct = _open_direct(path)
        self._refused = False  # O_DIRECT refused at a write: the rest written through the page cache
        # the load's reads of windows no longer held: no readahead, which could put pages of a window not yet
        # written in the page cache, racing with its O_DIRECT write (zeros served later)
        try:
            self._reader = os.open(path, os.O_RDONLY)
        except BaseException:
            self._close_direct()
            raise
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self._reader, 0, 0, os.POSIX_FADV_RANDOM)

    def hold_head(self, head: bytes) -> None:
        """Serve the file's first bytes ``head`` (in and checked) from memory until their window is written."""
        self._head = head

    # ------------------------------------------------------------------ the fetch
    def take(self) -> int:
        """A buffer for the next window (its slot: :meth:`view`): a free one, else the one holding the oldest window
        no read is copying from."""
        with self._cond:
            if self._memory is None:
                self._memory = _anonymous(self.count * self._room)
                self._base = ctypes.addressof(ctypes.c_char.from_buffer(self._memory))
            while True:
                if self._free:
                    slot = self._free.pop()
                    break
                idle = sorted(w for w, s in self._held.items() if not self._readers[s])
                if idle:
                    slot = self._held.pop(idle[0])
                    break
                self._cond.wait()
        return slot

    def view(self, slot: int) -> memoryview:
        """The buffer ``slot`` (:meth:`take`)."""
        assert self._memory is not None
        return memoryview(self._memory)[slot * self._room:(slot + 1) * self._room]

    def put(self, k: int, slot: int, end: int) -> None:
        """Write window ``k``, its bytes before ``end`` in buffer ``slot`` (:meth:`take`), into the copy, and hold it
        for the load's reads (OSError: the copy cannot be written; the buffer is then free again)."""
        start = k * self.window
        try:
            with self.view(slot) as buf:
                self._write(buf, start, end)
        except BaseException:
            self.put_back(slot)
            raise
        with self._cond:
            self._held[k] = slot
            self._cond.notify_all()

    def put_back(self, slot: int) -> None:
        """Free buffer ``slot`` without writing it (its window failed)."""
        with self._cond:
            self._free.append(slot)
            self._cond.notify_all()

    def _write(self, buf: memoryview, start: int, end: int) -> None:
        n = end - start
        if self._direct is not None and not self._refused:
            try:  # the tail rounded up to a block: the bytes past the end are cut off by finish()
                pwrite_all(self._direct, buf[:-(-n // BLOCK) * BLOCK], start)
                return
            except OSError as e:
                if e.errno not in _REFUSALS:
                    raise
                self._refused = True  # refused after all (the descriptor closed once no window is written)
        pwrite_all(self.fd, buf[:n], start)

    def finish(self) -> None:
        """Every window written: the copy cut to its size (an ``O_DIRECT`` tail was written rounded up), and the few
        pages of it the load read back (small pages, without readahead) dropped from the page cache: the next load
        finds the copy wholly cold and reads it as a local file is read cold (large pages: the loads after it read
        the copy as fast as a local file's)."""
        os.ftruncate(self.fd, self.size)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)

    # ------------------------------------------------------------------ the load
    def read(self, offset: int, buf: Any) -> bool:
        """Copy the bytes at ``offset`` (written and checked) into ``buf``: from the buffers of the windows held, the
        rest read from the copy (``preadv``, without readahead); the GIL released while copying. False, having read
        nothing, once the buffers are released (the fetch over: the caller reads the copy itself)."""
        mv = memoryview(buf).cast("B")
        if mv.readonly:
            raise TypeError("a read into a read-only buffer")
        with self._cond:
            if self._released:
                return False
            self._reading += 1
        try:
            pos = 0
            while pos < len(mv):
                pos += self._piece(offset + pos, mv[pos:])
        finally:
            with self._cond:
                self._reading -= 1
                self._cond.notify_all()
        return True

    def _piece(self, at: int, mv: memoryview) -> int:
        """Copy the bytes at ``at`` into ``mv`` up to the end of their window (or of the head held); how many."""
        k = at // self.window
        n = min(len(mv), (k + 1) * self.window - at)
        with self._cond:
            slot = self._held.get(k)
            if slot is not None:
                self._readers[slot] += 1
        if slot is None:
            head = self._head
            if at < len(head):
                n = min(n, len(head) - at)
                mv[:n] = head[at:at + n]
            else:
                pread_into(self._reader, mv[:n], at, path=self.path)
                self.read_back += n
            return n
        try:
            dst = (ctypes.c_char * n).from_buffer(mv[:n])  # a read-only buffer: TypeError, as a read into one
            ctypes.memmove(dst, self._base + slot * self._room + at - k * self.window, n)
        finally:
            with self._cond:
                self._readers[slot] -= 1
                self._cond.notify_all()
        return n

    def release(self) -> None:
        """Free the buffers (no read copying from them any more: later reads read the copy)."""
        with self._cond:
            while self._reading or any(self._readers):
                self._cond.wait()
            memory, self._memory = self._memory, None
            self._held.clear()
            self._released = True
            reader, self._reader = self._reader, -1
        self._close_direct()
        if reader >= 0:
            os.close(reader)
        if memory is not None:
            try:
                memory.close()
            except BufferError:  # a view still held by a failed read's traceback: unmapped when collected
                pass

    def _close_direct(self) -> None:
        fd, self._direct = self._direct, None
        if fd is not None:
            os.close(fd)


def _anonymous(n: int) -> mmap.mmap:
    """``n`` bytes of private anonymous memory, in huge pages where the kernel gives them (``MADV_HUGEPAGE``): the
    buffers' first touch is one fault per 2 MiB rather than per 4 KiB page. (Python's default anonymous mapping is
    shared: shmem, which takes no huge pages here.)"""
    mem = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        mem.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError):
        pass
    return mem


def _open_direct(path: str) -> int | None:
    """A descriptor of ``path`` for ``O_DIRECT`` writes, or None where the file system refuses them."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return None
    try:
        return os.open(path, os.O_WRONLY | flag)
    except OSError as e:
        if e.errno in _REFUSALS:
            return None
        raise
