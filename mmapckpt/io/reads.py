"""Positional reads of many regions: one stream in file order, or the process's reader threads.

A cold file reads best as one sequential stream (the kernel's readahead sees one
pattern); a cached one is a memory copy that several threads share.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ..records import Record
from .files import pread_into

__all__ = ["ReadJob", "submit_reads", "pread_all", "wait_all", "byte_runs", "pieces", "nbytes", "reader_pool",
           "READ_PIECE"]


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
    pool = reader_pool(threads)
    return [pool.submit(pread_all, fd, g, path) for g in byte_runs(pieces(jobs), threads)]


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


def pread_all(fd: int, pieces: list[ReadJob], path: str) -> None:
    """Read every piece, in the order given, on this thread."""
    for p in pieces:
        pread_into(fd, p.buf, p.offset, path=path, entry=p.entry)


def wait_all(futures: list[Future[None]]) -> None:
    """Wait for every read; then raise the first one's error, if any."""
    errors = [e for e in (f.exception() for f in futures) if e is not None]
    if errors:
        raise errors[0]
