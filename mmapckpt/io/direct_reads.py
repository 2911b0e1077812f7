"""Reading regions of a mapped file with ``preadv`` straight into CPU tensors.

Copying out of a mapping faults it in page by page; a read moves each byte once, and a
cold file is read the way measured best for its device (io/read_choice.py), whether its
regions go into CPU targets (:meth:`DirectReads.run`) or into staging buffers bound for an
accelerator (:meth:`DirectReads.read_many`, a buffer at a time). Used by MmapReader (for
``dcp.load``), ``mmapckpt.load_into`` and ``mmapckpt.load(device=...)``.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable

import torch

from . import read_choice
from .cold_reads import read_pieces
from .files import is_cached, pread_into
from .mapped import MappedFile
from .read_choice import STREAM, Segment, Strategy
from .reads import ReadJob, nbytes, pieces, submit_reads, wait_all

__all__ = ["DirectReads"]


#: Threads that read a file whose pages are already cached (the copy out of the cache is the cost).
_CACHED_READ_THREADS = max(1, min(4, os.cpu_count() or 1))
#: Regions of a cached file shorter than this are copied from the mapping (see take()).
SMALL_CACHED_COPY = 64 << 10
#: Cached reads start on those threads in batches of this many bytes, while the plan is still walked.
_BATCH = 64 << 20
#: A staging buffer's cold reads by ``buffered-N`` are cut into pieces no shorter than this, so that N
#: runs share even one block that fills the buffer (the CPU path's pieces are READ_PIECE long).
_STAGED_PIECE = 256 << 10


class DirectReads:
    """Regions of one mapped file read with ``preadv`` straight into contiguous CPU targets.

    Copying out of a mapping faults it in page by page: on a cold file that is many small
    synchronous reads, and even on a cached one the page-table work costs more than a read.
    A read moves each byte once. On opening, a few RWF_NOWAIT probes tell whether the
    ranges to be read are cached; if not, the jobs gathered during the walk run at its end,
    in file order on this thread (the kernel advised to read ahead, which it does up to its
    readahead window: 8-16 MB of a 1 GB file here, not the whole range); or, where this device reads faster with several
    streams at once, by the way io/read_choice.py chose for it (io/cold_reads.py), which the first
    large cold reads on a device measure. If they are cached, every ``_BATCH`` bytes of jobs start
    on the reader threads while the walk goes on. Staging buffers bound for an accelerator are
    filled the same way (:meth:`reader_for`, :meth:`read_many`), and a trial's reads may then span
    several buffers: each trial's bytes and seconds add up until :meth:`close` records them.
    """

    def __init__(self, file: MappedFile, *, enabled: bool = True, ranges: list[tuple[int, int]] = ()) -> None:
        self.file, self.enabled, self.fd, self.cached = file, enabled, -1, False
        self._base: int | None = None  # address of file offset 0 in the mapping
        self.jobs: list[tuple[ReadJob, Any, torch.Tensor]] = []
        self._pending: list[ReadJob] = []  # cached: jobs not yet started
        self._pending_bytes = 0
        self._started: list[Future[None]] = []
        self.segments: list[Segment] = []  # cold: how each part of the file is read
        self._cold: _ColdPlan | None = None
        if enabled:
            self._open([(o, n) for o, n in ranges if o >= 0 and n > 0])

    def _open(self, ranges: list[tuple[int, int]]) -> None:
        fd = self.file.dup()  # the file that was opened and mapped, never the path again
        st = os.fstat(fd)
        self.fd = fd
        step = max(1, len(ranges) // 16)
        self.cached = is_cached(fd, [off for o, n in ranges[::step] for off in (o, o + n - 1)])
        if self.cached:
            return
        ranges = sorted(ranges)
        self.segments = read_choice.plan(st.st_dev, ranges)
        self._cold = _ColdPlan(fd, self.file.path, self.file.ident, self.segments)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        for seg in self.segments:  # one stream: let the kernel read its whole range ahead now
            inside = [(o, n) for o, n in ranges if seg.lo <= o < seg.hi]
            if seg.strategy == STREAM and not seg.trial and inside:
                lo = inside[0][0]
                os.posix_fadvise(fd, lo, max(o + n for o, n in inside) - lo, os.POSIX_FADV_WILLNEED)

    def worth_reading(self, src: torch.Tensor) -> bool:
        """Whether a read may stand in for a copy of ``src`` out of the mapping: not for a few pages of a
        cached file, which cost less to copy than to queue (a caller can ask before making a label)."""
        return self.enabled and not (self.cached and src.nbytes < SMALL_CACHED_COPY)

    def take(self, src: torch.Tensor, target: torch.Tensor, token: Any, label: str) -> bool:
        """Queue the copy of ``src`` (a view of the mapping) into ``target`` if a read can do it.

        ``token`` comes back from :meth:`run` with ``target``; ``label`` names the entry in errors.
        """
        if not (self.enabled and target.device.type == "cpu" and target.dtype == src.dtype and src.numel()
                and target.is_contiguous() and src.is_contiguous() and not target.is_conj()
                and not target.is_neg()):
            return False
        if not self.worth_reading(src):
            return False
        if self._base is None:
            self._base = self.file.address()
        offset = src.data_ptr() - self._base
        buf = target.reshape(-1).view(torch.uint8).numpy()
        job = ReadJob(buf, offset, label)
        self.jobs.append((job, token, target))
        if self.cached:
            self._pending.append(job)
            self._pending_bytes += buf.nbytes
            if self._pending_bytes >= _BATCH:
                self._start()
        return True

    def reader_for(self, src: torch.Tensor, label: str | None = None) -> Callable[[torch.Tensor, int, int], None] | None:
        """For the staging pool: a function that reads ``src``'s bytes (a contiguous view of the mapping)
        from the file straight into a staging buffer, or None where a read cannot stand in for ``src``."""
        if not (self.enabled and src.numel() and src.is_contiguous()):
            return None
        if self._base is None:
            self._base = self.file.address()
        return _FileRead(self.fd, self.file.path, src.data_ptr() - self._base, label, self.cached,
                         None if self.cached else self)

    def read_many(self, items: list[tuple[torch.Tensor, int, int, str | None]]) -> None:
        """For the staging pool: fill a buffer's blocks of this cold file, ``(staged uint8 tensor, file offset,
        nbytes, label)`` each, by the file's read plan (the segment each block lies in says the way)."""
        jobs = [ReadJob(staged.numpy()[:n], offset, label) for staged, offset, n, label in items if n]
        if self._cold is None:  # a cached file (reader_for gives its readers no group): one pass in order
            for j in jobs:
                pread_into(self.fd, j.buf, j.offset, path=self.file.path, entry=j.entry)
            return
        self._cold.read(sorted(jobs, key=lambda j: j.offset), staged=True)

    def _start(self) -> None:
        if self._pending:
            self._started += submit_reads(self.fd, self._pending, threads=_CACHED_READ_THREADS, path=self.file.path)
            self._pending, self._pending_bytes = [], 0

    def run(self) -> list[tuple[Any, torch.Tensor]]:
        """Read every queued job; return (token, target) of each, now filled."""
        if not self.jobs:
            return []
        if self.cached:
            self._start()
            started, self._started = self._started, []
            wait_all(started)
        elif self._cold is not None:
            self._cold.read(pieces([j for j, _, _ in self.jobs]), staged=False)
        done = [(token, target) for _, token, target in self.jobs]
        self.jobs.clear()
        return done

    def close(self) -> None:
        """Wait for reads still running (after an error), record the trials' timings for the device, then
        close the descriptor the reads use."""
        started, self._started = self._started, []
        for fut in started:
            fut.exception()
        if self._cold is not None:
            self._cold.record()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class _ColdPlan:
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
        if read_pieces(self.fd, self.path, self.ident, part, way, advise=seg.trial):
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


class _FileRead:
    """A staging reader (``io.staging.Reader``): a contiguous source's bytes read from the file at their
    place. ``parallel`` where the file is cached: its reads are then memory copies that threads share;
    otherwise ``group`` is the file's :class:`DirectReads`, which reads a buffer's blocks by the file's plan."""

    __slots__ = ("fd", "path", "offset", "label", "parallel", "group")

    def __init__(self, fd: int, path: str, offset: int, label: str | None, parallel: bool,
                 group: DirectReads | None = None) -> None:
        self.fd, self.path, self.offset, self.label, self.parallel = fd, path, offset, label, parallel
        self.group = group

    def __call__(self, staged: torch.Tensor, start: int, nbytes: int) -> None:
        pread_into(self.fd, staged.numpy(), self.offset + start, path=self.path, entry=self.label)
