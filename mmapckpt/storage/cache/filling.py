"""A file fetched into its cache entry while the load that asked for it reads it: one fetch, one write, overlapped.

The first load of a remote file through the cache (storage.py, on a miss) starts :class:`Filling`: a thread
of this process fetches the file into ``NAME.tmp-PID`` (entry.py ``fill``: ranged GETs straight into the
copy's shared mapping, each window's CRC-32s computed as it arrives) while the load reads the copy through
:class:`FillingFile`. A read of a range waits until the fetch has brought in every byte before the range's
end and compared every entry those bytes belong to with the shard's header (``Checker.checked_to``): the
load is served only bytes fetched and checked, as from a published copy, and a range that fails its check
fails the read that waits for it (``ChecksumError``). So the load's copy into its targets runs while the
next windows arrive, instead of after the whole file.

The entry's rules stay: ``#lock`` is held from before the fetch until the copy is renamed into place and
its record written (other processes wait, then map it: one fetch per byte), the copy becomes visible only
complete and checked, and the fetching process holds a shared ``flock`` on the copy from the start (the
evictor removes nothing in use). A mapping of the file (a load that builds views over it) waits for the
whole fetch. A fetch that fails removes its temporary file; a killed one leaves it to the next fetch.
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import threading
from collections.abc import Callable
from typing import Any

from ...errors import CheckpointError
from ...io.files import unlink_quietly
from ...io.mapped import MappedFile
from ..base import CheckpointStorage, StoredFile
from .entry import CachedFile, Entry, fill

__all__ = ["Filling", "FillingFile"]


class Filling:
    """File ``name`` of ``remote`` being fetched into ``entry`` by a thread, ``#lock`` (descriptor ``lock``) held
    until it is in place. Opening the remote file, reserving the copy's room and opening the copy for the load
    happen here, before the thread starts (their OSError: the cache cannot take it). Attributes: ``version``, the
    remote version fetched; ``file``, the load's :class:`FillingFile`."""

    def __init__(self, entry: Entry, remote: CheckpointStorage, name: str,
                 version_of: Callable[[StoredFile], list[Any]], lock: int, after: Callable[[], None]) -> None:
        self.entry, self.after = entry, after
        self._cond = threading.Condition()
        self._ready, self._done, self._error = 0, False, None  # bytes before _ready: in and checked
        self._served = 0  # reads copying out of the mapping now (it is closed once there are none)
        entry.clear_leftovers()
        self._rf = remote.open_file(name)
        fd = rfd = -1
        self.tmp = f"{entry.data}.tmp-{os.getpid()}"
        try:
            self.version = version_of(self._rf)
            self.size = self._rf.size
            fd = os.open(self.tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            if self.size:  # no room: an OSError here, never a SIGBUS on a write into the mapping
                os.posix_fallocate(fd, 0, self.size)
            self._mm = None if not self.size else mmap.mmap(fd, self.size, flags=mmap.MAP_SHARED,
                                                             prot=mmap.PROT_READ | mmap.PROT_WRITE)
            self._at = 0 if self._mm is None else ctypes.addressof(ctypes.c_char.from_buffer(self._mm))
            rfd = os.open(self.tmp, os.O_RDONLY)
            fcntl.flock(rfd, fcntl.LOCK_SH)  # what the copy will be: in use by this process (evict.py)
            self.file = FillingFile(rfd, entry.data, self.size, entry.url, self)
        except BaseException:
            for d in (fd, rfd):
                if d >= 0:
                    os.close(d)
            self.close_mapping()
            unlink_quietly(self.tmp)
            self._rf.close()
            raise
        self._fd, self._lock = fd, lock
        self._thread = threading.Thread(target=self._run, name="mmapckpt-cache-fill")
        self._thread.start()

    def _progress(self, ready: int) -> None:
        with self._cond:
            self._ready = ready
            self._cond.notify_all()

    def _run(self) -> None:
        ok = False
        try:
            check = fill(self._mm, self._rf, self.entry.url, self._progress)
            self.entry.publish(self.tmp, self._fd, self.version, check)
            ok = True
        except BaseException as e:  # noqa: BLE001 - handed to the reads that wait for it
            self._error = e
            unlink_quietly(self.tmp)
        finally:
            self._rf.close()
            os.close(self._fd)
            os.close(self._lock)  # the others waiting for this file map the copy now
            with self._cond:
                self._done = True
                self._ready = self.size if ok else self._ready
                self._cond.notify_all()
        if ok:
            try:
                self.after()
            except Exception:  # noqa: BLE001 - eviction is best effort (the next fetch evicts again)
                pass

    def copy_out(self, offset: int, buf: Any) -> None:
        """Copy the bytes at ``offset`` (in and checked: :meth:`wait`) into ``buf`` from the fetch's own mapping of
        the copy (its pages already mapped: no page-cache lookups), the GIL released (``ctypes.memmove``)."""
        mv = memoryview(buf).cast("B")
        n = len(mv)
        if not n:
            return
        dst = (ctypes.c_char * n).from_buffer(mv)  # a read-only buffer: TypeError, as a read into one is
        with self._cond:
            if self._mm is None:
                raise ValueError(f"read of a closed file ({self.entry.data})")
            self._served += 1
        try:
            ctypes.memmove(dst, self._at + offset, n)
        finally:
            with self._cond:
                self._served -= 1
                self._cond.notify_all()

    def close_mapping(self) -> None:
        """Unmap the fetch's mapping (the fetch over and no read copying out of it)."""
        cond = getattr(self, "_cond", None)
        if cond is None:
            return
        with cond:
            while getattr(self, "_served", 0):
                cond.wait()
            mm, self._mm = getattr(self, "_mm", None), None
        if mm is not None:
            try:
                mm.close()
            except BufferError:  # still exported (ctypes): unmapped when collected
                pass

    def wait(self, end: int, *, whole: bool = False) -> None:
        """Return once the bytes before ``end`` are in and checked (``whole``: once the copy is in place).

        Raises:
            CheckpointError: the fetch failed (the store's error, or ``ChecksumError``: the bytes fetched failed
                their check) before it got that far; nothing is cached.
        """
        with self._cond:
            while not (self._done if whole else self._done or self._ready >= end):
                self._cond.wait()
            if self._error is not None and (whole or self._ready < end):
                e = self._error
                if isinstance(e, CheckpointError):
                    raise e
                raise CheckpointError(f"the fetch into the cache failed ({e}): load again (or without the cache)",
                                      path=self.entry.url) from e

    @property
    def done(self) -> bool:
        """Whether the fetch is over (the copy in place, or failed)."""
        return self._done

    def join(self) -> None:
        """Wait until the fetch is over (the copy in place, or the failure handled)."""
        if threading.current_thread() is not self._thread:
            self._thread.join()


class FillingFile(CachedFile):
    """The copy being fetched, served to the load that fetches it: each read waits for its bytes (:class:`Filling`)."""

    def __init__(self, fd: int, path: str, size: int, url: str, filling: Filling) -> None:
        super().__init__(fd, path, size, url)
        self.filling = filling

    def read_into(self, offset: int, buf: Any, *, entry: str | None = None) -> None:
        n = memoryview(buf).nbytes
        if offset < 0 or offset + n > self.size or self.fd < 0:
            super().read_into(offset, buf, entry=entry)  # its errors (past the end, closed)
            return
        self.filling.wait(offset + n)
        self.filling.copy_out(offset, buf)

    def read_batch(self, fetches: list[tuple[int, Any]], *, entry: str | None = None) -> None:
        for offset, buf in sorted(fetches, key=lambda f: f[0]):  # in the order the fetch brings them in
            self.read_into(offset, buf, entry=entry)

    @property
    def mapping(self) -> MappedFile | None:
        """None while the fetch goes on: the load reads the file as it reads a remote one (each range into its
        target once it is in), instead of waiting for the whole of it to build views; the copy's mapping once it
        is in place."""
        if not self.filling.done:
            return None
        self.filling.wait(self.size, whole=True)
        return super().mapping

    def close(self) -> None:
        """Close the copy; the fetch goes on to put it in place (waited for here, so that a load that returns
        leaves its files cached)."""
        super().close()
        self.filling.join()
        self.filling.close_mapping()
