"""A cold file's read plan at work: each piece read by the way io/read_choice.py chose for the segment it lies in.

io/direct_reads.py makes one for a file whose pages are not cached (and imports this module only then: a load
of cached files needs neither the choice of a way nor the ways, io/cold_reads.py and io/odirect.py).
"""

from __future__ import annotations

import threading
import time

from . import read_choice
from .cold_reads import read_pieces
from .read_choice import STREAM, Segment, Strategy
from .reads import ReadJob, nbytes

__all__ = ["ColdPlan"]

#: A staging buffer's cold reads by ``buffered-N`` are cut into pieces no shorter than this, so that N
#: runs share even one block that fills the buffer (the CPU path's pieces are READ_PIECE long).
_STAGED_PIECE = 256 << 10


class ColdPlan:
    """A cold file's read plan at work: each piece read by the way of the segment it lies in, the trial
    segments timed. Reads may come from several threads and in several calls (a staging buffer at a time),
    so each trial's bytes and seconds add up until :meth:`record`."""

    def __init__(self, fd: int, path: str, ident: tuple[int, int], segments: list[Segment]) -> None:
        self.fd, self.path, self.ident = fd, path, ident
        self.segments = segments or [Segment(STREAM, 0, 1 << 63, False)]
        self._timed: dict[int, list[float]] = {}  # trial segment -> [bytes, seconds]
        self._refused: set[int] = set()  # segments whose O_DIRECT the file refused: read as one stream
        self._dropped: set[int] = set()  # trials not to record: refused, or a read failed
        self._lock = threading.Lock()

    def read(self, todo: list[ReadJob], *, staged: bool) -> None:
        """Read ``todo`` (in file order). ``staged``: one staging buffer's blocks, which ``buffered-N`` cuts
        into pieces so that its N runs share them."""
        for i, seg in enumerate(self.segments):
            part = [p for p in todo if seg.lo <= p.offset < seg.hi]
            if part:
                try:
                    self._read_segment(i, seg, part, staged)
                except BaseException:
                    self._drop(i)  # the time of a read that failed says nothing about the way
                    raise

    def _read_segment(self, i: int, seg: Segment, part: list[ReadJob], staged: bool) -> None:
        way = STREAM if i in self._refused else seg.strategy
        if staged and way.kind == "buffered":
            part = _cut(part, way)
        t0 = time.perf_counter()
        if read_pieces(self.fd, self.path, self.ident, part, way):
            if seg.trial and way == seg.strategy:
                seconds = time.perf_counter() - t0
                with self._lock:
                    if i not in self._dropped:
                        timed = self._timed.setdefault(i, [0, 0.0])
                        timed[0] += sum(nbytes(p.buf) for p in part)
                        timed[1] += seconds
            return
        with self._lock:  # O_DIRECT refused: read as one stream, now and for the rest of the segment
            first = i not in self._refused
            self._refused.add(i)
        self._drop(i)
        if first:
            read_choice.unsupported(self.ident[0], seg.strategy)
        read_pieces(self.fd, self.path, self.ident, part, STREAM)

    def _drop(self, i: int) -> None:
        with self._lock:
            self._dropped.add(i)
            self._timed.pop(i, None)

    def record(self) -> None:
        """Add each trial's throughput to the device's samples (once)."""
        with self._lock:
            timed, self._timed = self._timed, {}
        for i, (n, seconds) in sorted(timed.items()):
            read_choice.record(self.ident[0], self.segments[i].strategy, int(n), seconds)


def _cut(part: list[ReadJob], way: Strategy) -> list[ReadJob]:
    """``part`` in pieces of about a ``2 * way.streams``-th of its bytes (at least ``_STAGED_PIECE``)."""
    total = sum(nbytes(p.buf) for p in part)
    size = max(_STAGED_PIECE, -(-total // (2 * way.streams)))
    out = []
    for p in part:
        n = nbytes(p.buf)
        if n <= size:
            out.append(p)
            continue
        mv = memoryview(p.buf).cast("B")
        out += [ReadJob(mv[at:at + size], p.offset + at, p.entry) for at in range(0, n, size)]
    return out
