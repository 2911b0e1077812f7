"""Reading regions of a mapped file with ``preadv`` straight into CPU tensors.

Copying out of a mapping faults it in page by page; a read moves each byte once, and a
cold file is read the way measured best for its device (io/read_choice.py), whether its
regions go into CPU targets (:meth:`DirectReads.run`) or into staging buffers bound for an
accelerator (:meth:`DirectReads.read_many`, a buffer at a time). Used by MmapReader (for
``dcp.load``), ``mmapckpt.load_into`` and ``mmapckpt.load(device=...)``.
"""

from __future__ import annotations

import ctypes
import os
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Callable

import torch

from .files import is_cached, pread_into
from .mapped import MappedFile
from .reads import ReadJob, byte_runs, pieces, pread_all, submit_runs, wait_all

if TYPE_CHECKING:
    from .cold_plan import ColdPlan
    from .read_choice import Segment

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
    in file order on this thread (the kernel reading ahead by its own window, unadvised:
    io/cold_reads.py); or, where this device reads faster with several streams at once and the read
    is long enough (``read_choice.PARALLEL_BYTES``), by the way io/read_choice.py chose for it
    (io/cold_reads.py), which the first large cold reads on a device measure. If they are cached, every
    ``_BATCH`` bytes of jobs start on the reader threads while the walk goes on. Staging buffers bound
    for an accelerator are filled the same way (:meth:`reader_for`, :meth:`read_many`), and a trial's
    reads may then span several buffers: each trial's bytes and seconds add up until :meth:`close`
    records them.
    """

    def __init__(self, file: MappedFile, *, enabled: bool = True, ranges: list[tuple[int, int]] = ()) -> None:
        self.file, self.enabled, self.fd, self.cached = file, enabled, -1, False
        self._base: int | None = None  # address of file offset 0 in the mapping
        self.jobs: list[tuple[ReadJob, Any, torch.Tensor]] = []
        self._pending: list[ReadJob] = []  # cached: jobs not yet started
        self._pending_bytes = 0
        self._started: list[Future[None]] = []
        self.segments: list[Segment] = []  # cold: how each part of the file is read
        self._cold: ColdPlan | None = None
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
        # a cold file only: the choice of a way to read it and the ways themselves (a cached one needs neither)
        from . import read_choice
        from .cold_plan import ColdPlan

        self.segments = read_choice.plan(st.st_dev, sorted(ranges))
        # no posix_fadvise for one stream: the kernel's own readahead (see io/cold_reads.py)
        self._cold = ColdPlan(fd, self.file.path, self.file.ident, self.segments)

    def take(self, src: torch.Tensor, target: torch.Tensor, token: Any, label: Callable[[], str] | str) -> bool:
        """Queue the copy of ``src`` (a view of the mapping) into ``target`` if a read can do it and is worth it: not
        for a few pages of a cached file (below ``SMALL_CACHED_COPY``), which cost less to copy than to queue.

        ``token`` comes back from :meth:`run` with ``target``; ``label`` names the entry in errors (or makes the
        name: called only for a read queued).
        """
        # the cheapest tests first, each asked once: a load calls this for every tensor
        if not (self.enabled and target.is_cpu and target.dtype == src.dtype and target.is_contiguous()
                and src.is_contiguous() and not target.is_conj() and not target.is_neg()):
            return False
        n = src.nbytes
        if not n or (self.cached and n < SMALL_CACHED_COPY):
            return False
        base = self._base
        if base is None:
            base = self._base = self.file.address()
        job = ReadJob(_bytes_of(target, n), src.data_ptr() - base, label if isinstance(label, str) else label())
        self.jobs.append((job, token, target))
        if self.cached:
            self._pending.append(job)
            self._pending_bytes += n
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

    def _start(self, *, here: bool = False) -> None:
        """Start the pending jobs on the reader threads; ``here``: the last batch, whose last run this thread reads
        itself once the others are started (it would wait for them anyway; a new process starts one thread
        fewer). The started reads are kept until waited for, also where this thread's own run raises."""
        if self._pending:
            runs = byte_runs(pieces(self._pending), _CACHED_READ_THREADS)
            self._pending, self._pending_bytes = [], 0
            mine = runs.pop() if here else None
            self._started += submit_runs(self.fd, runs, threads=_CACHED_READ_THREADS, path=self.file.path)
            if mine:
                pread_all(self.fd, mine, self.file.path)

    def run(self) -> list[tuple[Any, torch.Tensor]]:
        """Read every queued job; return (token, target) of each, now filled."""
        if not self.jobs:
            return []
        if self.cached:
            self._start(here=True)
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


def _bytes_of(target: torch.Tensor, nbytes: int) -> memoryview:
    """The ``nbytes`` bytes of the contiguous CPU tensor ``target`` as a writable byte view, no copy (a ctypes array
    over its data: 0.5 us, where ``reshape(-1).view(torch.uint8).numpy()`` makes three objects in 2.5 us). It does
    not keep ``target`` alive: the job's caller does (``DirectReads.jobs`` holds every target until it is read)."""
    return memoryview((ctypes.c_char * nbytes).from_address(target.data_ptr())).cast("B")


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
