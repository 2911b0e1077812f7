"""Reading regions of a mapped file with ``preadv`` straight into CPU tensors.

Copying out of a mapping faults it in page by page; a read moves each byte once, and a
cold file is read the way measured best for its device (io/read_choice.py). Used by
MmapReader (for ``dcp.load``) and by ``mmapckpt.load_into``.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import Future
from typing import Any, Callable

import torch

from . import read_choice
from .cold_reads import read_pieces
from .files import is_cached, pread_into
from .mapped import MappedFile
from .read_choice import STREAM, Segment
from .reads import ReadJob, nbytes, pieces, submit_reads, wait_all

__all__ = ["DirectReads"]


#: Threads that read a file whose pages are already cached (the copy out of the cache is the cost).
_CACHED_READ_THREADS = max(1, min(4, os.cpu_count() or 1))
#: Regions of a cached file shorter than this are copied from the mapping (see take()).
SMALL_CACHED_COPY = 64 << 10
#: Cached reads start on those threads in batches of this many bytes, while the plan is still walked.
_BATCH = 64 << 20


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
    on the reader threads while the walk goes on.
    """

    def __init__(self, file: MappedFile, *, enabled: bool = True, ranges: list[tuple[int, int]] = ()) -> None:
        self.file, self.enabled, self.fd, self.cached = file, enabled, -1, False
        self._base: int | None = None  # address of file offset 0 in the mapping
        self.jobs: list[tuple[ReadJob, Any, torch.Tensor]] = []
        self._pending: list[ReadJob] = []  # cached: jobs not yet started
        self._pending_bytes = 0
        self._started: list[Future[None]] = []
        self.segments: list[Segment] = []  # cold: how each part of the file is read
        if enabled:
            self._open([(o, n) for o, n in ranges if o >= 0 and n > 0])

    def _open(self, ranges: list[tuple[int, int]]) -> None:
        try:
            fd = os.open(self.file.path, os.O_RDONLY)
        except FileNotFoundError:  # removed since it was mapped (a later save's clean-up): read the mapping
            self.enabled = False
            return
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != self.file.ident:
            os.close(fd)  # replaced since it was mapped: the mapping is the file to read
            self.enabled = False
            return
        self.fd = fd
        step = max(1, len(ranges) // 16)
        self.cached = is_cached(fd, [off for o, n in ranges[::step] for off in (o, o + n - 1)])
        if self.cached:
            return
        ranges = sorted(ranges)
        self.segments = read_choice.plan(st.st_dev, ranges)
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
        return _FileRead(self.fd, self.file.path, src.data_ptr() - self._base, label, self.cached)

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
        else:
            self._run_cold(pieces([j for j, _, _ in self.jobs]))
        done = [(token, target) for _, token, target in self.jobs]
        self.jobs.clear()
        return done

    def _run_cold(self, todo: list[ReadJob]) -> None:
        """Read the pieces of each segment by its way; time the trials and record them for the device."""
        dev = self.file.ident[0]
        for seg in self.segments or [Segment(STREAM, 0, 1 << 63, False)]:
            part = [p for p in todo if seg.lo <= p.offset < seg.hi]
            if not part:
                continue
            t0 = time.perf_counter()
            if not read_pieces(self.fd, self.file.path, self.file.ident, part, seg.strategy, advise=seg.trial):
                read_choice.unsupported(dev, seg.strategy)  # O_DIRECT refused: read as one stream
                read_pieces(self.fd, self.file.path, self.file.ident, part, STREAM)
            elif seg.trial:
                read_choice.record(dev, seg.strategy, sum(nbytes(p.buf) for p in part), time.perf_counter() - t0)

    def close(self) -> None:
        """Wait for reads still running (after an error), then close the descriptor they use."""
        started, self._started = self._started, []
        for fut in started:
            fut.exception()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class _FileRead:
    """A staging reader (``io.staging.Reader``): a contiguous source's bytes read from the file at their
    place. ``parallel`` where the file is cached: its reads are then memory copies that threads share."""

    __slots__ = ("fd", "path", "offset", "label", "parallel")

    def __init__(self, fd: int, path: str, offset: int, label: str | None, parallel: bool) -> None:
        self.fd, self.path, self.offset, self.label, self.parallel = fd, path, offset, label, parallel

    def __call__(self, staged: torch.Tensor, start: int, nbytes: int) -> None:
        pread_into(self.fd, staged.numpy(), self.offset + start, path=self.path, entry=self.label)
