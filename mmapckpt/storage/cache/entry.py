"""One cached file: its directory, its record, its locks, how it is fetched and how it is served.

An entry is the directory ``ROOT/KK/KEY/`` (``KEY`` a hash of the remote file's URL) holding

- the copy, under the file's own base name (``__0_0.distcp``), written only by a fetch that holds
  ``#lock``: fetched into ``NAME.tmp-PID`` through a shared writable mapping (each byte lands in the
  page cache as it arrives, one copy), checked (check.py), then renamed to ``NAME``; the load that
  fetches it reads each range once it is in and checked, while the rest arrives (filling.py);
- ``#record``: JSON naming the URL, the remote version the copy is of (its size and the medium's
  identity of it, the ETag on S3), how the copy was checked, the boot it was written in, and the
  copy's inode, size, mtime and ctime when it was put in place. Written after the copy (temp file
  and rename), removed before a copy is replaced: a record describes a complete, checked copy;
- ``#lock``: held exclusively by the one process fetching (the others wait on it) and by the evictor.

A process serving the copy opens it and takes a shared ``flock`` on it; the mapping made from that
descriptor keeps the lock (Python's mmap holds a duplicate of the descriptor) for as long as any
view of it lives, and the evictor removes only copies it can lock exclusively (evict.py).

At each open (:meth:`Entry.open_hit`) the copy is served only if the record names the version the
remote has now (the caller asked the medium: one HEAD) and the copy is still the file put in place
(``fstat``: same inode, size, mtime and ctime; any write, truncation or replacement through the
file system changes one). A copy written in an earlier boot of the machine was not necessarily on
disk when the machine went down: it is checked again once (its CRC-32s, a pass over its bytes), or
fetched again where it has none.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import mmap
import os
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ...io.files import MADV_POPULATE_WRITE, advise_unlocked, atomic_write, unlink_quietly
from ..local import LocalFile
from .check import CRC32, Checker, check_copy

__all__ = ["Entry", "CachedFile", "fill", "ident_of", "LOCK", "RECORD"]

LOCK, RECORD = "#lock", "#record"
#: A file's first 64 KiB are read on their own, in two small reads: the S3 medium serves reads shorter than
#: that from the GET that opened the object (it keeps its first 64 KiB), so a fetch asks for each byte once.
_FIRST = 64 << 10
#: The rest is fetched in windows of at most this many bytes, each one request of the medium, checked when it is in:
#: windows the size of the requests a load without the cache makes (``StoredFile.request_shape``: 64 MiB for 1 GB
#: over S3's 16 threads), half as many in flight as it has threads (see _fetch_checked).
_WINDOW = 64 << 20


def ident_of(size: int, ident: Any) -> list[Any]:
    """A remote file's version as the record keeps it (JSON)."""
    return [size, json.dumps(ident, default=str, sort_keys=True)]


def boot_id() -> str:
    """This boot of the machine (copies written in another were perhaps not on disk when it went down)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _stat_of(st: os.stat_result) -> list[int]:
    return [st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


class CachedFile(LocalFile):
    """The cached copy of a remote file, opened by :meth:`Entry.open_hit` with a shared lock on it: a local
    file (mapped, read with ``preadv``) whose descriptor, and any mapping of it, keeps the copy from eviction.

    Attributes:
        url: the remote file it is a copy of.
    """

    def __init__(self, fd: int, path: str, size: int, url: str) -> None:
        st = os.fstat(fd)
        self.fd, self.path, self.size, self.url = fd, path, size, url
        self.ident = (st.st_dev, st.st_ino)
        self._mapping = None


class Entry:
    """The cache entry of the remote file ``url`` under the cache directory ``root`` (module docstring)."""

    def __init__(self, root: str, url: str) -> None:
        key = hashlib.sha256(url.encode()).hexdigest()
        self.url = url
        self.dir = os.path.join(root, key[:2], key[2:34])
        base = re.sub(r"[^A-Za-z0-9._-]", "_", url.rsplit("/", 1)[-1])[-120:].lstrip(".") or "file"
        self.data = os.path.join(self.dir, base)
        self.record = os.path.join(self.dir, RECORD)

    # ------------------------------------------------------------------ serving
    def read_record(self) -> dict[str, Any] | None:
        try:
            with open(self.record, "rb") as f:
                rec = json.loads(f.read())
            return rec if isinstance(rec, dict) and rec.get("url") == self.url else None
        except (OSError, ValueError):
            return None

    def open_hit(self, version: list[Any]) -> CachedFile | None:
        """The copy, open and shared-locked, if it is of ``version`` (:func:`ident_of`) and intact; else None."""
        rec = self.read_record()
        if rec is None or rec.get("version") != version:
            return None
        try:
            fd = os.open(self.data, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)  # the evictor holds it exclusively only while it removes the file
            st = os.fstat(fd)
            if st.st_nlink == 0 or _stat_of(st) != rec.get("stat") or (
                    rec.get("boot") != boot_id() and not self._check_again(fd, rec)):
                os.close(fd)
                return None
        except BaseException:
            os.close(fd)
            raise
        try:
            os.utime(self.record)  # last use, for the evictor's order
        except OSError:
            pass
        return CachedFile(fd, self.data, version[0], self.url)

    def _check_again(self, fd: int, rec: dict[str, Any]) -> bool:
        """A copy written in an earlier boot: its CRC-32s checked again (then the record names this boot), or
        False where it has none (fetched again)."""
        if rec.get("check") != CRC32:
            return False
        size = rec["version"][0]
        try:
            with mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ) as mm:
                check_copy(mm, self.url)
        except Exception:
            return False
        try:
            atomic_write(self.record, json.dumps({**rec, "boot": boot_id()}).encode(), sync=False)
        except OSError:
            pass  # checked again at the next open
        return True

    # ------------------------------------------------------------------ fetching
    def lock(self) -> int:
        """Take ``#lock`` exclusively (waiting for a fetch in progress in another process); its descriptor, whose
        closing releases it."""
        os.makedirs(self.dir, exist_ok=True)
        fd = os.open(os.path.join(self.dir, LOCK), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def clear_leftovers(self) -> None:
        """Remove a killed fetch's leftovers (its lock died with it); ``#lock`` held."""
        for n in os.listdir(self.dir):
            if ".tmp-" in n:
                unlink_quietly(os.path.join(self.dir, n))

    def publish(self, tmp: str, fd: int, version: list[Any], check: str) -> None:
        """Put the complete, checked copy ``tmp`` (open as ``fd``) in place and write its record (``#lock`` held)."""
        unlink_quietly(self.record)  # no record describes a copy being replaced
        os.rename(tmp, self.data)
        st = os.fstat(fd)
        rec = {"url": self.url, "version": version, "check": check, "boot": boot_id(), "stat": _stat_of(st)}
        atomic_write(self.record, json.dumps(rec).encode(), sync=False)


def fill(mm: Any, rf: Any, url: str, progress: Callable[[int], None]) -> str:
    """Read the whole of the remote file ``rf`` into ``mm``, a shared writable mapping of the new file (its room
    reserved: ``posix_fallocate``; None for an empty file): the medium's reads land in the page cache, checked as
    they arrive (check.py: the CRC-32s of each window computed by the thread that fetched it, while the next ones
    are fetched); how it was checked. ``progress(n)`` hears, in order, that the bytes before ``n`` are in and
    checked (``Checker.checked_to``)."""
    size = rf.size
    checker = Checker(url, size)
    if not size:
        checker.start(b"")
        return checker.finish()
    mv = memoryview(mm)
    try:
        first = min(size, _FIRST)
        rf.read_into(0, mv[:first // 2])
        rf.read_into(first // 2, mv[first // 2:first])
        head = max(first, checker.needs(mv[:first]))
        if head > first:  # a shard header longer than the first bytes
            rf.read_batch([(first, mv[first:head])])
        checker.start(mv[:head])
        progress(checker.checked_to(head))
        _fetch_checked(rf, mm, mv, head, checker, progress)
        return checker.finish()
    finally:
        try:
            mv.release()
        except BufferError:  # a view still held by a failed read's traceback: released when collected
            pass


def _populate(mm: Any, a: int, b: int) -> None:
    """Fault in the pages of ``[a, b)`` of the copy's shared mapping ``mm`` for writing, in one call, before the
    fetch writes them. Measured (1 GB, 4 threads reading the copy with ``preadv`` after the fetch): the pages a
    fetch faults in one by one as its reads land cost 1.34x local's CPU to read again (215 against 160 ms), the
    pages populated a window at a time 0.88x (166 against 189 ms): every warm load reads them. The call releases
    the GIL (io/files.py ``advise_unlocked``): the other windows' requests and checks and the load's copies go on
    while one window's pages are zeroed. Where the kernel lacks it, the writes fault the pages in as before."""
    advise_unlocked(mm, a, b - a, MADV_POPULATE_WRITE)


def _fetch_checked(rf: Any, mm: Any, mv: memoryview, start: int, checker: Checker,
                   progress: Callable[[int], None]) -> None:
    """Fetch ``[start, end)`` of ``rf`` into ``mv`` (a view of the mapping ``mm``) in windows, each one request
    of the medium (``read_request``) of the size a load without the cache asks for, half as many in flight as
    that load has threads; the thread that fetched a window computes its CRC-32s (check.py ``Checker.part``:
    several windows checked at once, on several cores, while the next arrive), combined in order as each
    completes, and the entries it completes compared with the header at once (``progress``: how far the file is
    in and checked). Each window's pages are put in the page cache in one call before its bytes arrive
    (:func:`_populate`).

    Measured against radosgw, 1 GB, alternating in one process (10 rounds): windows of 64 MiB read as 16 MiB
    requests, 3 in flight (12 requests at once), took 1.957 s against 1.246 s for the load without the cache;
    each window one 64 MiB request, 8 in flight, 1.460 s (faster in 8 of 10 pairs). In flight (8 rounds): 4,
    1.779 s; 8, 1.538 s; 16, 1.572 s. Half the threads, as fast as all of them, leaves windows to complete in
    order while the last are fetched, for the load to copy out of."""
    request, threads = rf.request_shape()
    window = max(1, min(_WINDOW, request))
    windows = [(o, min(o + window, len(mv))) for o in range(start, len(mv), window)]

    def one(a: int, b: int) -> list[tuple[int, int, int]]:
        _populate(mm, a, b)
        rf.read_request(a, mv[a:b])
        return checker.part(a, mv[a:b])
    with ThreadPoolExecutor(max(2, threads // 2), thread_name_prefix="mmapckpt-cache") as pool:
        futures = [pool.submit(one, a, b) for a, b in windows]
        try:
            for (_, b), fut in zip(windows, futures):
                checker.add(fut.result())
                progress(checker.checked_to(b))
        except BaseException:
            for fut in futures:
                fut.cancel()
            raise
