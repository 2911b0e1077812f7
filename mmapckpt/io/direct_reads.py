"""Reading regions of a mapped file with ``preadv`` straight into CPU tensors.

Copying out of a mapping faults it in page by page; a read moves each byte once, and
on a cold file lets the kernel read ahead in one stream. Used by MmapReader (for
``dcp.load``) and by ``mmapckpt.load_into``.
"""

from __future__ import annotations

import os
from concurrent.futures import Future
from typing import Any, Callable

import torch

from .files import is_cached, pread_into
from .mapped import MappedFile
from .reads import ReadJob, pread_jobs, submit_reads

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
    ranges to be read are cached; if not, the kernel is asked at once to read them ahead,
    so the disk works while the plan is walked, and the jobs gathered during the walk run
    at its end, in file order on this thread. If they are cached, every ``_BATCH`` bytes of
    jobs start on the reader threads while the walk goes on.
    """

    def __init__(self, file: MappedFile, *, enabled: bool = True, ranges: list[tuple[int, int]] = ()) -> None:
        self.file, self.enabled, self.fd, self.cached = file, enabled, -1, False
        self._base: int | None = None  # address of file offset 0 in the mapping
        self.jobs: list[tuple[ReadJob, Any, torch.Tensor]] = []
        self._pending: list[ReadJob] = []  # cached: jobs not yet started
        self._pending_bytes = 0
        self._started: list[Future[None]] = []
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
        if ranges and not self.cached:  # one stream; let the kernel read the whole range ahead now
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            lo = min(o for o, _ in ranges)
            os.posix_fadvise(fd, lo, max(o + n for o, n in ranges) - lo, os.POSIX_FADV_WILLNEED)

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
            _wait_all(started)
        else:
            pread_jobs(self.fd, [j for j, _, _ in self.jobs], path=self.file.path)
        done = [(token, target) for _, token, target in self.jobs]
        self.jobs.clear()
        return done

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


def _wait_all(futures: list[Future[None]]) -> None:
    """Wait for every read; then raise the first one's error, if any."""
    errors = [e for e in (f.exception() for f in futures) if e is not None]
    if errors:
        raise errors[0]
