"""Positional reads of many regions: one stream in file order, or the process's reader threads.

A cold file reads best as one sequential stream (the kernel's readahead sees one
pattern); a cached one is a memory copy that several threads share.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import Any, Callable

from ..records import Record
from .files import pread_into

__all__ = ["ReadJob", "submit_reads", "submit_runs", "submit_tasks", "run_tasks", "pread_all", "wait_all", "byte_runs",
           "pieces", "nbytes", "reader_pool", "READ_PIECE", "GATHER_GAP"]


class ReadJob(Record):
    """Read ``len(buf)`` bytes at ``offset`` into ``buf``; ``entry`` names it in errors."""

    __slots__ = ()

    buf: Any
    offset: int
    entry: str | None

    def __new__(cls, buf: Any, offset: int, entry: str | None) -> ReadJob:
        return tuple.__new__(cls, (buf, offset, entry))


#: Reads are split into pieces of at most this size, so that threads share long entries.
READ_PIECE = 32 << 20


def submit_reads(fd: int, jobs: list[ReadJob], *, threads: int, path: str) -> list[Future[None]]:
    """Start ``jobs`` on the process's reader threads, as ``threads`` runs of about equal bytes.

    One task per run: a task per piece would cost more in hand-offs than thousands of small
    reads take. The caller must wait for every future before it closes ``fd``.
    """
    return submit_runs(fd, byte_runs(pieces(jobs), threads), threads=threads, path=path)


def submit_runs(fd: int, runs: list[list[ReadJob]], *, threads: int, path: str) -> list[Future[None]]:
    """Start each run (pieces in file order) as one task on the process's reader threads (``threads`` of them)."""
    return submit_tasks([partial(pread_all, fd, g, path) for g in runs], threads=threads)


def run_tasks(tasks: list[Callable[[], None]], *, threads: int) -> None:
    """Run every task, all but the last on the reader threads (``threads`` of them) and the last on this thread,
    which would wait for them anyway (a new process starts one thread fewer); return once all are done, then
    raise the first error (this thread's before the others')."""
    futures = submit_tasks(tasks[:-1], threads=threads)
    try:
        if tasks:
            tasks[-1]()
    except BaseException:
        for fut in futures:
            fut.exception()  # every read done before the caller closes what they read from
        raise
    wait_all(futures)


def submit_tasks(tasks: list[Callable[[], None]], *, threads: int) -> list[Future[None]]:
    """Start each task on the process's reader threads (``threads`` of them)."""
    if not tasks:
        return []
    pool = reader_pool(threads)
    return [pool.submit(t) for t in tasks]


def byte_runs(jobs: list[ReadJob], runs: int) -> list[list[ReadJob]]:
    """``jobs`` (in file order) cut into at most ``runs`` consecutive runs of about equal bytes."""
    groups: list[list[ReadJob]] = [[] for _ in range(runs)]
    total, done = sum(nbytes(p.buf) for p in jobs), 0
    for p in jobs:
        groups[min(runs - 1, done * runs // max(total, 1))].append(p)
        done += nbytes(p.buf)
    return [g for g in groups if g]


def pieces(jobs: list[ReadJob]) -> list[ReadJob]:
    """The jobs in file order, long ones split into READ_PIECE pieces so that threads can share them."""
    out = []
    for j in sorted(jobs, key=lambda j: j.offset):
        n = nbytes(j.buf)
        if n <= READ_PIECE:
            out.append(j)
            continue
        mv = memoryview(j.buf).cast("B")
        for start in range(0, n, READ_PIECE):
            out.append(ReadJob(mv[start:start + READ_PIECE], j.offset + start, j.entry))
    return out


_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def reader_pool(threads: int) -> ThreadPoolExecutor:
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


def nbytes(buf: Any) -> int:
    return buf.nbytes if hasattr(buf, "nbytes") else len(memoryview(buf).cast("B"))


#: Pieces at most this far apart are read by one ``preadv`` (the gap's bytes land in a scratch buffer, dropped).
GATHER_GAP = 64 << 10
#: One ``preadv`` reads at most this many bytes, into at most this many buffers (Linux's IOV_MAX is 1024).
_GATHER_BYTES, _GATHER_BUFFERS = 64 << 20, 512
#: Where the gaps' bytes go: shared by every thread, since nothing reads it.
_SCRATCH = memoryview(bytearray(GATHER_GAP))


def pread_all(fd: int, pieces: list[ReadJob], path: str) -> None:
    """Read every piece, in the order given, on this thread.

    Neighbouring pieces (in file order, at most :data:`GATHER_GAP` apart: an entry and the next one after its
    alignment padding) are read by one ``preadv`` into their buffers: one system call, and one release of the
    interpreter lock, per run of entries instead of per entry (a load of a few hundred small tensors spent more
    on the calls than on the copies).
    """
    i, n = 0, len(pieces)
    while i < n:
        first = pieces[i]
        bufs = [memoryview(first.buf).cast("B")]
        end, j = first.offset + len(bufs[0]), i + 1
        while j < n and len(bufs) < _GATHER_BUFFERS - 1 and end - first.offset < _GATHER_BYTES:
            p = pieces[j]
            gap = p.offset - end
            if not 0 <= gap <= GATHER_GAP:
                break
            if gap:
                bufs.append(_SCRATCH[:gap])
            mv = memoryview(p.buf).cast("B")
            bufs.append(mv)
            end, j = p.offset + len(mv), j + 1
        if j == i + 1:
            pread_into(fd, first.buf, first.offset, path=path, entry=first.entry)
        else:
            got = os.preadv(fd, bufs, first.offset)
            if got < end - first.offset:  # short (the file ends early): the rest piece by piece, which says where
                _read_rest(fd, pieces[i:j], max(got, 0), path)
        i = j


def _read_rest(fd: int, run: list[ReadJob], got: int, path: str) -> None:
    """Finish the pieces of ``run`` (read by one call from ``run[0].offset``, of which ``got`` bytes came) one by one
    from the first byte not read."""
    reached = run[0].offset + got
    for p in run:
        mv = memoryview(p.buf).cast("B")
        done = min(max(reached - p.offset, 0), len(mv))
        if done < len(mv):
            pread_into(fd, mv[done:], p.offset + done, path=path, entry=p.entry)


def wait_all(futures: list[Future[None]]) -> None:
    """Wait for every read; then raise the first one's error, if any."""
    errors = [e for e in (f.exception() for f in futures) if e is not None]
    if errors:
        raise errors[0]
