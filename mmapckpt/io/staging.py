"""Host-to-accelerator copies through a bounded ring of pinned buffers: the one staging pipeline.

Copies to an accelerator are asynchronous only from pinned (page-locked) host memory;
from mapped file pages the driver copies synchronously through a small bounce buffer
of its own, faulting pages in the middle of the transfer. So every host-to-device load
(``dcp.load`` with MmapReader, ``load_into``, ``mmapckpt.load(device=...)``) goes through
:class:`StagingPool`:

- each source is cut into blocks of at most ``staging_bytes`` whose bytes are
  contiguous in the source (:func:`plan_blocks`): a tensor larger than a buffer is
  streamed in pieces;
- blocks are packed into the current buffer while they fit (64-byte aligned), so small
  tensors share one buffer, with one copy per target slice;
- a block is filled by a read from the file straight into the buffer where the caller
  gives one (``read=``: ``preadv``, no page faults), or gathered from the source tensor,
  which may be a strided, narrowed region of a stored chunk (resharding);
- when the host leaves a buffer (the next block does not fit), the buffer goes to the pool's
  filler thread and the caller goes on packing the next one: the filler runs the buffer's
  fills (from a cached file, whose reader says ``parallel``, cut into about equal shares
  for ``FILL_THREADS`` threads: one thread copies out of the page cache at a fraction of a
  PCIe 5 link, 5-10 GB/s against 55 on an H200 host, where 8 threads reached 22-49; from a
  cold one, handed together to the file's reads (the reader's ``group``), which read them
  the way measured best for the device: one stream, several buffered streams or several
  O_DIRECT ones, io/direct_reads.py), then issues its copies ``non_blocking`` on a side
  stream and records an event. So the caller's planning, the fills of one buffer and the
  device's copies out of the one before all overlap;
- before packing a buffer again the caller waits for its fills and that event, so at most
  ``staging_buffers`` are in use; a fill's error comes out of that wait, or of ``flush``;
- ``done`` callbacks (the reader's ``commit_tensor``) run only once the copy of the
  item's last block, and so of the whole item, has completed.

Sources are read late, on the filler thread: :meth:`StagingPool.seal` returns once none is
left to read, and a loader calls it before it closes the files (reading/moves.py).

Stream discipline: :meth:`StagingPool.begin` makes the side stream wait for the
caller's current stream (the destinations may have been allocated or written on it),
and :meth:`StagingPool.flush` synchronises the side stream before anyone uses the
destinations, also when an error interrupts a load.

On the CPU (``device="cpu"``) the same loop runs with ordinary buffers, the filler's copies
synchronous; tests use that to check the blocks, the packing, the ring, the filler thread and
the callbacks without a GPU.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from .host_register import registry_from_env
from .reads import reader_pool
from .ring import DeviceSide, Filler, Gather, Ring, Slot
from .staging_options import (DEFAULT_STAGING_BUFFERS, DEFAULT_STAGING_BYTES, check_device, needs_staging,
                              staging_options)

__all__ = ["Block", "plan_blocks", "StagingPool", "DEFAULT_STAGING_BYTES", "DEFAULT_STAGING_BUFFERS",
           "FILL_THREADS", "staging_options", "stage", "needs_staging", "STAGE_CPU_TARGETS", "check_device"]

#: Threads that fill a buffer from cached files. On H200 hosts (16 cores), three runs of
#: benchmarks/cuda_bench.py moved 4.7-9.9 GB/s with 1 thread, 15-21 with 4, 22-49 with 8 and 19-23 with 16.
FILL_THREADS = max(1, min(8, os.cpu_count() or 1))
#: A buffer's reads are shared out only in pieces of at least this many bytes (a smaller piece
#: costs more to hand to a thread than to read).
_FILL_PIECE = 1 << 20
#: Offsets of packed blocks inside a buffer (covers every dtype's alignment; DMA likes it).
_ALIGN = 64

#: Tests only: route CPU targets through the pipeline too (ordinary buffers), so that the
#: same code that serves accelerators is checked on a machine without one. Read through
#: staging_options.stage_cpu_targets, which finds it only once this module is imported.
STAGE_CPU_TARGETS = False

#: Benchmarks only: called with a pool's :attr:`StagingPool.stats` (and its size) when it closes.
STATS_HOOK: Callable[[dict[str, Any]], None] | None = None

#: ``read(staged, start, nbytes)``: fill ``staged`` with the source's bytes ``[start, start + nbytes)``.
#: Any part of a range may be read on its own; a reader with a true ``parallel`` attribute (a
#: cached file) may be called from several threads at once. A reader that is not ``parallel`` may
#: carry a ``group`` (not None: the reads of one cold file, with a method ``read_many(items)``) with
#: ``offset`` (the file offset of the source's byte 0) and ``label`` (the entry, for errors): a buffer's
#: fills of one group are then handed to it in one call, as ``(staged, file offset, nbytes, label)``
#: items in buffer order, so that it can read them together the way it reads that file best.
Reader = Callable[[torch.Tensor, int, int], None]
#: A read to run when the host leaves the buffer: (reader, staged bytes, source start, nbytes).
_Fill = tuple[Reader, torch.Tensor, int, int]


@dataclass(frozen=True)
class Block:
    """A hypercube of a C-contiguous tensor whose bytes are contiguous.

    ``index`` selects it (ints for the leading dimensions, then at most one slice;
    later dimensions whole); its bytes are ``[start, start + nbytes)`` of the tensor's.
    """

    index: tuple[int | slice, ...]
    start: int
    nbytes: int


def _prod(xs: tuple[int, ...]) -> int:
    n = 1
    for x in xs:
        n *= x
    return n


def plan_blocks(shape: tuple[int, ...], itemsize: int, cap: int) -> Iterator[Block]:
    """Cut a C-contiguous tensor into blocks of at most ``cap`` bytes, in byte order.

    Whole runs of rows where a row fits, otherwise row by row recursively; so a
    block is at least half a buffer except at the end of a row. Empty tensors have none.
    """
    if cap < itemsize:
        raise ValueError(f"buffer of {cap} bytes cannot hold one {itemsize}-byte element")

    def rec(prefix: tuple[int | slice, ...], dims: tuple[int, ...], base: int) -> Iterator[Block]:
        total = itemsize * _prod(dims)
        if total == 0:
            return
        if total <= cap:
            yield Block(prefix, base, total)
            return
        row = itemsize * _prod(dims[1:])
        if row <= cap:
            per = cap // row
            for r in range(0, dims[0], per):
                r1 = min(dims[0], r + per)
                yield Block(prefix + (slice(r, r1),), base + r * row, (r1 - r) * row)
        else:
            for r in range(dims[0]):
                yield from rec(prefix + (r,), dims[1:], base + r * row)

    yield from rec((), tuple(shape), 0)


def _align_up(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class StagingPool:
    """A ring of ``staging_buffers`` (pinned) host buffers of ``staging_bytes`` each, staging copies to ``device``.

    Allocated once and reused across loads (pinned allocation is slow); :meth:`close`
    frees it. One load at a time: :meth:`copy` may be called from several threads, which
    take turns. Use a load as ``with pool:`` (``begin`` on entry, ``flush`` on exit).
    A buffer's fills and copies run on the pool's filler thread while the caller packs the
    next one (see the module's docstring); :attr:`stats` says where the time went.

    ``registry`` (io/host_register.py; default :func:`registry_from_env`): views of a file mapping
    (``copy(mapping=...)``) are copied by the device straight from their registered pages.

    Example:
        >>> with StagingPool("cuda") as pool:
        ...     pool.copy(cpu_tensor, cuda_tensor, done=lambda: print("copied"))
    """

    def __init__(self, device: str | torch.device, *, staging_bytes: int = DEFAULT_STAGING_BYTES,
                 staging_buffers: int = DEFAULT_STAGING_BUFFERS, pin: bool | None = None,
                 registry: Any = None) -> None:
        if staging_buffers < 1 or staging_bytes < 1:
            raise ValueError(f"need staging_buffers >= 1 and staging_bytes >= 1, got {staging_buffers}, "
                             f"{staging_bytes}")
        self.device = torch.device(device)
        pin = self.device.type != "cpu" if pin is None else pin
        self.staging_bytes = staging_bytes
        self.registry = registry if registry is not None else registry_from_env(self.device)
        #: seconds the caller waited for a buffer to come free (its fills and copies), the filler spent
        #: filling and issuing copies; buffers sealed; bytes copied from registered pages (kept across loads)
        self.stats = {"wait_s": 0.0, "fill_s": 0.0, "issue_s": 0.0, "buffers": 0, "registered_bytes": 0}
        self._ring = Ring(staging_buffers, staging_bytes, pin, self.stats,
                          self.registry.release if self.registry is not None else lambda handle: None)
        self._fills: list[_Fill] = []  # the current buffer's fills, run when the host leaves it
        self._copies: list[tuple[torch.Tensor, torch.Tensor]] = []  # then its (target, source) copies
        self._cur: int | None = None  # the buffer being packed, how far, and the next one to take
        self._fill = 0
        self._lock = threading.RLock()
        self._filler, self._side = Filler(), DeviceSide(self.device)
        self._abandon = False  # set while a failed load's queued fills drain: they skip their work
        self._closed = False

    @property
    def blocks_per_buffer(self) -> list[int]:
        """Blocks packed into each buffer over the pool's life."""
        return [s.blocks for s in self._ring.slots]

    @property
    def buffers(self) -> list[torch.Tensor]:
        """The ring's host buffers (none once closed)."""
        return [s.buf for s in self._ring.slots]

    @property
    def max_in_use(self) -> int:
        """The most buffers in use at once."""
        return self._ring.max_in_use

    # ------------------------------------------------------------------ a load
    def __enter__(self) -> StagingPool:
        self.begin()
        return self

    def __exit__(self, exc_type: Any, *exc: object) -> None:
        self.flush(commit=exc_type is None)

    def begin(self) -> None:
        """Order the caller's current stream (where the destinations were made) before the copies."""
        self._side.begin()

    def flush(self, *, commit: bool = True) -> None:
        """Wait until every copy issued has finished, then run their ``done`` callbacks (unless ``commit`` is
        False). A fill that failed is raised here (when committing), after everything in flight has settled."""
        with self._lock:
            try:
                self.seal(run=commit)  # a load that failed: its targets are not used, nothing more is read
            except BaseException:
                self._ring.settle_all(self._side, commit=False)
                raise
            self._ring.settle_all(self._side, commit=commit)

    def seal(self, *, run: bool = True) -> None:
        """The host leaves the current buffer (its fills and copies go to the filler), and returns once no
        fill handed to :meth:`copy` is left to run: its sources and files may then be closed. A fill that
        failed is raised. ``run=False`` (after an error) drops the current buffer's fills, has the queued
        ones skip theirs, and raises nothing."""
        with self._lock:
            self._leave(run=run)
            self._abandon = not run
            try:
                error = self._ring.wait_fills()
            finally:
                self._abandon = False
            if run and error is not None:
                raise error

    def close(self) -> None:
        """Wait for the copies in flight and free the buffers (the pool cannot be used afterwards)."""
        if not self._closed:
            self.flush(commit=False)
            count, self._closed, self._ring.slots = len(self._ring.slots), True, []
            self._filler.close()
            if self.registry is not None:
                self.registry.close()
            if STATS_HOOK is not None:
                STATS_HOOK(_report(self, count))

    # ------------------------------------------------------------------ copies
    def copy(self, src: torch.Tensor, dst: torch.Tensor, *, done: Callable[[], None] | None = None,
             read: Reader | None = None, mapping: tuple[int, int] | None = None) -> None:
        """Issue the copy of CPU tensor ``src`` into ``dst`` (same shape and dtype, any strides).

        ``read``, for a C-contiguous ``src`` that lies contiguously in a file, fills a
        buffer from the file instead of from ``src`` (which may then be a meta tensor standing
        for the file's bytes). ``src`` (or the file) is read later, on the filler thread: it must
        not change before :meth:`seal` or :meth:`flush` returns. ``mapping``: the address range of
        the file mapping ``src`` is a view of (for the registry). ``done`` runs once the copy has
        completed (at the latest in :meth:`flush`).
        """
        sources = ("cpu", "meta") if read is not None else ("cpu",)
        if src.device.type not in sources or src.shape != dst.shape or src.dtype != dst.dtype:
            raise ValueError(f"cannot stage {src.dtype} {list(src.shape)} on {src.device} into "
                             f"{dst.dtype} {list(dst.shape)}")
        if self._closed:
            raise ValueError("the staging pool is closed")
        with self._lock:
            last = None
            if mapping is not None and self.registry is not None and src.is_contiguous() and src.device.type == "cpu":
                for b in plan_blocks(tuple(src.shape), src.element_size(), self.registry.window_bytes):
                    s, d = src[b.index], dst[b.index]
                    last = self._registered(s, d, mapping)
                    if last is None:  # over the budget with nothing in flight, or the registry refused: stage it
                        shifted = read and _Shifted(read, b.start)
                        for piece in plan_blocks(tuple(s.shape), s.element_size(), self.staging_bytes):
                            last = self._put(s, d, piece, shifted)
            else:
                for b in plan_blocks(tuple(src.shape), src.element_size(), self.staging_bytes):
                    last = self._put(src, dst, b, read)
            if done is not None and last is None:  # nothing to copy (an empty tensor): complete at once
                done()
            elif done is not None:
                self._ring.slots[last].done.append(done)

    def _put(self, src: torch.Tensor, dst: torch.Tensor, b: Block, read: Reader | None) -> int:
        i, off = self._space(b.nbytes)
        slot = self._ring.slots[i]
        staged, piece = slot.buf[off:off + b.nbytes], src[b.index]
        self._fills.append((read or Gather(piece), staged, b.start, b.nbytes))
        self._copies.append((dst[b.index], staged.view(src.dtype).view(piece.shape)))
        slot.blocks += 1
        return i

    def _registered(self, src: torch.Tensor, dst: torch.Tensor, mapping: tuple[int, int]) -> int | None:
        """Copy contiguous ``src`` straight from its registered pages, riding on the current buffer (its windows
        are released once that buffer's copies have completed): that buffer; None where the registry cannot."""
        handle = self.registry.acquire(src.data_ptr(), src.nbytes, bounds=mapping)
        order = self._ring.order
        while handle is None and order:  # over the budget: the oldest buffer's windows come free with its copies
            if order[0] == self._cur:
                self._leave(run=True)  # the only one: hand it to the filler first
            self._ring.wait_through(order[0])
            handle = self.registry.acquire(src.data_ptr(), src.nbytes, bounds=mapping)
        if handle is None:
            return None
        i, _ = self._space(0)
        self._ring.slots[i].held.append((handle, src))  # src keeps the mapping alive under the copy
        self._copies.append((dst, src))
        self.stats["registered_bytes"] += src.nbytes
        return i

    def _space(self, nbytes: int) -> tuple[int, int]:
        """A place for ``nbytes``: after what the current buffer holds, or at the start of the next one."""
        if self._cur is not None:
            off = _align_up(self._fill)
            if off + nbytes <= self.staging_bytes:
                self._fill = off + nbytes
                return self._cur, off
            self._leave(run=True)
        i = self._ring.take()
        self._cur, self._fill = i, nbytes
        return i, 0

    def _leave(self, *, run: bool) -> None:
        """Hand the current buffer's fills and copies to the filler (or drop them: ``run=False``)."""
        i, self._cur = self._cur, None
        fills, copies, self._fills, self._copies = self._fills, self._copies, [], []
        if i is not None and run:
            self.stats["buffers"] += 1
            slot = self._ring.slots[i]
            slot.sealed = self._filler.submit(self._fill_and_issue, slot, fills, copies)

    def _fill_and_issue(self, slot: Slot, fills: list[_Fill], copies: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """On the filler thread: fill the buffer, then issue its copies and record the event its reuse waits for."""
        if self._abandon:
            return
        t0 = time.perf_counter()
        run_fills(fills, FILL_THREADS)
        t1 = time.perf_counter()
        slot.event = self._side.issue(copies)
        self.stats["fill_s"] += t1 - t0
        self.stats["issue_s"] += time.perf_counter() - t1


def _report(pool: StagingPool, count: int) -> dict[str, Any]:
    """A closed pool's counters, its shape, and its registry's, for :data:`STATS_HOOK`."""
    out = dict(pool.stats, device=str(pool.device), staging_bytes=pool.staging_bytes, staging_buffers=count,
               max_in_use=pool.max_in_use)
    if pool.registry is not None:
        r = pool.registry.stats()
        out.update(register_s=r.register_s, unregister_s=r.unregister_s, registrations=r.registrations,
                   register_peak_bytes=r.peak_bytes)
    return out


class _Shifted:
    """A reader of a piece of a source: ``read``'s bytes from ``shift`` on (its ``parallel`` and ``group`` kept)."""

    def __init__(self, read: Reader, shift: int) -> None:
        self.read, self.shift = read, shift
        self.parallel = getattr(read, "parallel", False)
        if getattr(read, "group", None) is not None:
            self.group, self.offset, self.label = read.group, read.offset + shift, read.label  # type: ignore[attr-defined]

    def __call__(self, staged: torch.Tensor, start: int, nbytes: int) -> None:
        self.read(staged, start + self.shift, nbytes)


def run_fills(fills: list[_Fill], threads: int) -> None:
    """Run a buffer's reads: those of ``parallel`` readers cut into about equal shares for up to
    ``threads`` threads (this one included); those of a reader's ``group`` handed to it in one call
    on this thread (it may start threads of its own); the others in order on this thread."""
    shared = []
    grouped: dict[int, tuple[Any, list[tuple[torch.Tensor, int, int, str | None]]]] = {}
    for f in fills:
        read = f[0]
        group = None if getattr(read, "parallel", False) else getattr(read, "group", None)
        if group is not None:
            grouped.setdefault(id(group), (group, []))[1].append((f[1], read.offset + f[2], f[3], read.label))
        elif getattr(read, "parallel", False):
            shared.append(f)
        else:
            read(*f[1:])
    for group, items in grouped.values():
        group.read_many(items)
    if not shared:
        return
    total = sum(f[3] for f in shared)
    k = max(1, min(threads, total // _FILL_PIECE))
    share = -(-total // k)
    groups: list[list[_Fill]] = [[] for _ in range(k)]
    g, room = 0, share
    for read, staged, start, nbytes in shared:
        done = 0
        while done < nbytes:
            take = min(nbytes - done, room)
            groups[g].append((read, staged[done:done + take], start + done, take))
            done, room = done + take, room - take
            if room == 0 and g < k - 1:
                g += 1
                room = share if g < k - 1 else total  # the last group takes whatever is left
    futures = [reader_pool(k).submit(_run_group, grp) for grp in groups[1:] if grp]
    try:
        _run_group(groups[0])
    finally:
        errors = [e for e in (f.exception() for f in futures) if e is not None]
    if errors:
        raise errors[0]


def _run_group(group: list[_Fill]) -> None:
    for read, staged, start, nbytes in group:
        read(staged, start, nbytes)


def stage(pool: StagingPool, src: torch.Tensor, dst: torch.Tensor, done: Callable[[], None],
          read: Reader | None = None, mapping: tuple[int, int] | None = None) -> None:
    """Copy ``src`` into accelerator tensor ``dst`` through ``pool``, casting where their dtypes differ.

    A cast (``Tensor.copy_`` semantics) goes through a device tensor of the stored dtype,
    cast on the caller's stream once the staged copy is complete, before ``done``.
    ``read`` and ``mapping`` are :meth:`StagingPool.copy`'s.
    """
    if src.dtype == dst.dtype:
        pool.copy(src, dst, done=done, read=read, mapping=mapping)
        return
    tmp = torch.empty(src.shape, dtype=src.dtype, device=dst.device)

    def cast_then_done() -> None:
        dst.copy_(tmp)
        done()

    pool.copy(src, tmp, done=cast_then_done, read=read, mapping=mapping)
