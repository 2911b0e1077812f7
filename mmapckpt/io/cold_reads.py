"""Reading a cold file's regions into memory one of the ways of io/read_choice.py.

- ``stream``: every piece in file order on this thread through the caller's descriptor, the
  kernel reading ahead by its own window, without advice: ``POSIX_FADV_SEQUENTIAL`` (twice the
  window) and ``POSIX_FADV_WILLNEED`` over the range (the kernel starts reading one window of it,
  at most 16 MiB, inside the call) each made one stream slower. Fresh processes, cold ``load_into``
  of 323 tensors on the development VM (readahead 8 MiB), alternately with and without both: 50 MB 65.0 -> 47.0 ms
  (faster in 15 of 16 pairs), 128 MB 103.4 -> 86.4 ms (9 of 10); with the disk's readahead set
  to 128 KiB, 46.5 -> 43.8 ms (10 of 10) and 77.8 -> 77.3 ms (5 of 8);
- ``buffered-N``: N contiguous runs of about equal bytes at once, each on a reader thread
  through its own open file description of the caller's file (opened again through
  ``/proc/self/fd``, never by its path): the kernel keeps readahead state per open file, and
  threads sharing one descriptor break each other's sequential pattern, and each is advised
  ``POSIX_FADV_SEQUENTIAL`` (without it, ``buffered-4`` read 1 GB in 0.52 s against 0.47 s, at
  1.5 times the CPU);
- ``direct-N``: N runs of O_DIRECT reads of aligned 4 MiB blocks into page-aligned buffers,
  each block's bytes then copied into the pieces it holds; gaps of up to :data:`GAP` bytes
  between pieces are read through rather than split into more requests (the file opened again
  O_DIRECT the same way).

Every way fills the same bytes; a file shorter than a piece raises TruncatedFileError.
"""

from __future__ import annotations

import os
from functools import partial
from typing import Sequence

import numpy as np

from ..errors import TruncatedFileError
from .odirect import BLOCK, BUFFER_SIZE, give_back, take_buffer
from .read_choice import Strategy
from .reads import ReadJob, byte_runs, nbytes, pread_all, run_tasks

__all__ = ["read_pieces", "GAP"]

#: Pieces closer than this are read by one span of O_DIRECT blocks (the gap's bytes are read and dropped).
GAP = 1 << 20


def read_pieces(fd: int, path: str, ident: tuple[int, int], pieces: Sequence[ReadJob], strategy: Strategy) -> bool:
    """Fill every piece (in file order) from the file ``fd`` has open (``ident``: its st_dev, st_ino).

    Returns False, having read nothing, where the file refuses the way (O_DIRECT on a tmpfs); the caller reads
    another way.
    """
    if not pieces:
        return True
    if strategy.kind == "stream":
        pread_all(fd, list(pieces), path)
        return True
    if strategy.kind == "direct":
        dfd = _open_direct(fd, ident)
        if dfd is None:
            return False
        try:
            run_tasks([partial(_direct_run, dfd, run, path) for run in _spans_runs(pieces, strategy.streams)],
                      threads=strategy.streams)
        finally:
            os.close(dfd)
        return True
    run_tasks([partial(_buffered_run, fd, path, ident, run) for run in byte_runs(pieces, strategy.streams)],
              threads=strategy.streams)
    return True


def _reopen(fd: int, ident: tuple[int, int], flags: int) -> int | None:
    """A new open file description of the file ``fd`` has open, with ``flags`` (its own readahead state; O_DIRECT):
    opened through ``/proc/self/fd``, which names the open file itself, never its path again (a file renamed over
    the path, or the path removed, changes nothing). None where that is refused (no ``/proc``; O_DIRECT on a file
    system without it) or, as a guard, where it is not the file ``ident`` (st_dev, st_ino)."""
    try:
        own = os.open(f"/proc/self/fd/{fd}", flags)
    except OSError:  # EINVAL where the file system refuses O_DIRECT: the caller reads another way
        return None
    st = os.fstat(own)
    if (st.st_dev, st.st_ino) != ident:
        os.close(own)
        return None
    return own


def _open_direct(fd: int, ident: tuple[int, int]) -> int | None:
    """The open file opened again O_DIRECT; None where that is refused."""
    if not hasattr(os, "O_DIRECT"):
        return None
    return _reopen(fd, ident, os.O_RDONLY | os.O_DIRECT)


def _buffered_run(fd: int, path: str, ident: tuple[int, int], run: list[ReadJob]) -> None:
    """One run on an open file description of its own (its own readahead state); a copy of ``fd`` (which shares
    ``fd``'s) where the file cannot be opened again."""
    own = _reopen(fd, ident, os.O_RDONLY)
    own = os.dup(fd) if own is None else own
    try:
        os.posix_fadvise(own, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        pread_all(own, run, path)
    finally:
        os.close(own)


class _Span:
    """Pieces whose bytes are read as one run of aligned blocks from ``lo`` (aligned) to ``hi``."""

    __slots__ = ("lo", "hi", "pieces")

    def __init__(self, p: ReadJob) -> None:
        self.lo, self.hi, self.pieces = p.offset - p.offset % BLOCK, p.offset + nbytes(p.buf), [p]


def _spans_runs(pieces: Sequence[ReadJob], streams: int) -> list[list[tuple[int, int, list[ReadJob]]]]:
    """The blocks to read, ``(offset, length, pieces overlapping it)``, in ``streams`` runs of about equal bytes."""
    spans: list[_Span] = []
    for p in pieces:
        if spans and p.offset - spans[-1].hi <= GAP:
            s = spans[-1]
            s.hi = max(s.hi, p.offset + nbytes(p.buf))
            s.pieces.append(p)
        else:
            spans.append(_Span(p))
    blocks: list[tuple[int, int, list[ReadJob]]] = []
    for s in spans:
        i = 0
        for off in range(s.lo, s.hi, BUFFER_SIZE):
            end = min(off + BUFFER_SIZE, s.hi)
            while i < len(s.pieces) and s.pieces[i].offset + nbytes(s.pieces[i].buf) <= off:
                i += 1
            j, inside = i, []
            while j < len(s.pieces) and s.pieces[j].offset < end:
                inside.append(s.pieces[j])
                j += 1
            length = -(-(end - off) // BLOCK) * BLOCK
            blocks.append((off, length, inside))
    total = sum(b[1] for b in blocks)
    runs: list[list[tuple[int, int, list[ReadJob]]]] = [[] for _ in range(streams)]
    done = 0
    for b in blocks:
        runs[min(streams - 1, done * streams // max(total, 1))].append(b)
        done += b[1]
    return [r for r in runs if r]


def _direct_run(dfd: int, run: list[tuple[int, int, list[ReadJob]]], path: str) -> None:
    buf = take_buffer(BUFFER_SIZE)
    view = memoryview(buf)
    arr: np.ndarray | None = np.frombuffer(buf, dtype=np.uint8)
    try:
        for off, length, inside in run:
            got = _read_block(dfd, view[:length], off)
            for p in inside:
                dst = np.frombuffer(p.buf, dtype=np.uint8)
                lo, hi = max(off, p.offset), min(off + length, p.offset + dst.size)
                if off + got < hi:
                    raise TruncatedFileError(f"file ended at offset {off + got} while reading", path=path,
                                             entry=p.entry)
                dst[lo - p.offset:hi - p.offset] = arr[lo - off:hi - off]  # type: ignore[index]
    finally:
        arr = None  # the buffer's exports end before it is kept or closed
        view.release()
        give_back(buf)


def _read_block(dfd: int, view: memoryview, off: int) -> int:
    """Read aligned ``view`` at ``off``; the bytes read (fewer only at the end of the file)."""
    got = 0
    while got < len(view):
        n = os.preadv(dfd, [view[got:]], off + got)
        if n <= 0:
            break
        got += n
        if got % BLOCK:  # a short read ends at the end of the file
            break
    return got
