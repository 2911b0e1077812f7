"""How the bytes of a stored region reach their target: one named strategy per kind of move, chosen in one place.

Every reader (``dcp.load`` with MmapReader, ``load_into``, ``load(device=...)``) ends with a
stored region as a CPU tensor ``src`` (a view over the file's mapping, or bytes decoded into
memory) and a target ``dst`` of the same shape. :class:`Moves`, one per file being read, picks
the strategy for each pair (:meth:`Moves.strategy`) and hands the pair to it:

- :class:`Staged`: a target on an accelerator (or every target, in the tests that check the
  pipeline on the CPU): through the pinned staging ring (io/staging.py), whose buffers are
  filled by reading the file (``preadv``) where the source lies contiguously in it;
- :class:`DirectRead`: a contiguous CPU target of the source's dtype, worth a read: ``preadv``
  straight into the target (io/direct_reads.py), queued while the plan is walked and run at
  the end of the file (:meth:`Moves.finish`), which also starts the kernel's readahead of a
  cold file at once;
- :class:`Fetched`: a file without a mapping (an object): its sources are placeholders
  (reading/fetches.py), read straight into contiguous CPU targets in batches at the end of
  the file, or into memory first and copied;
- :class:`MappedCopy`: everything else, and what the others fall back to: ``Tensor.copy_`` out
  of the source.

``done`` runs once the target holds the bytes: at once, at :meth:`Moves.finish`, or when the
staged copy has completed. Read-once loads (dcp/deliver.py) move whole stored records between
ranks over the process group: that strategy works a level above, on records, and hands each
rank's own items to these.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterable, Protocol

import torch

from ..io.direct_reads import DirectReads
from ..io.mapped import MappedFile
from ..io.staging_options import stage_cpu_targets
from ..storage.base import StoredFile

if TYPE_CHECKING:  # the pipeline (io/staging.py) is imported by the staged moves only, on their first use
    from ..io.staging import StagingPool
    from .fetches import FetchReads  # the reads of files without a mapping, imported where there is one

__all__ = ["Move", "MappedCopy", "DirectRead", "Fetched", "Staged", "Moves", "close_all"]

Done = Callable[[], None]
#: The entry's name for errors, made only where a strategy needs it (most copies never do).
Label = Callable[[], str]


class Move(Protocol):
    """One way of moving a source's bytes into a target."""

    #: the strategy's name, as benchmarks and messages say it
    name: str

    def take(self, src: torch.Tensor, dst: torch.Tensor, label: Label, done: Done) -> bool:
        """Move ``src`` into ``dst`` (now or later; ``done`` once it is there); False where this way cannot."""
        ...


class MappedCopy:
    """``dst.copy_(src)``: out of a mapped view (pages fault in as they are touched), or out of memory."""

    name = "mapped"

    def take(self, src: torch.Tensor, dst: torch.Tensor, label: Label, done: Done) -> bool:
        dst.copy_(src)
        done()
        return True


class DirectRead:
    """``preadv`` from the file straight into a contiguous CPU target (deferred to :meth:`Moves.finish`)."""

    name = "direct"

    def __init__(self, reads: DirectReads) -> None:
        self.reads = reads

    def take(self, src: torch.Tensor, dst: torch.Tensor, label: Label, done: Done) -> bool:
        return self.reads.take(src, dst, done, label)


class Fetched:
    """Reads of a file without a mapping straight into contiguous CPU targets (deferred to :meth:`Moves.finish`);
    other targets get the region read into memory and copied."""

    name = "fetched"

    def __init__(self, reads: FetchReads) -> None:
        self.reads = reads

    def take(self, src: torch.Tensor, dst: torch.Tensor, label: Label, done: Done) -> bool:
        if self.reads.take(src, dst, done, label()):
            return True
        dst.copy_(self.reads.materialize(src, label()))
        done()
        return True


class Staged:
    """Through the pinned staging ring of the target's device, its buffers read from the file where they can be."""

    name = "staged"

    def __init__(self, pool_for: Callable[[torch.device], StagingPool], reads: DirectReads | FetchReads | None) -> None:
        self.pool_for, self.reads = pool_for, reads
        #: the devices this file's moves went to (their pools are sealed before the file closes)
        self.devices: set[torch.device] = set()

    def take(self, src: torch.Tensor, dst: torch.Tensor, label: Label, done: Done) -> bool:
        from ..io.staging import stage  # imported by now: the caller made the pool

        read = self.reads.reader_for(src, label()) if self.reads is not None else None
        if read is None and self.reads is not None and not isinstance(self.reads, DirectReads):  # FetchReads
            src = self.reads.materialize(src, label())  # a placeholder not contiguous in the file
        device = dst.device
        self.devices.add(device)
        pool = self.pool_for(device)
        mapping = None
        # registering a cold file's pages would read it by page faults: only cached files' pages are registered
        if (pool.registry is not None and isinstance(self.reads, DirectReads) and self.reads.cached
                and src.device.type == "cpu"):
            base, ptr = self.reads.file.address(), src.data_ptr()
            if base <= ptr and ptr + src.nbytes <= base + self.reads.file.size:  # a view of the mapping (not
                mapping = (base, base + self.reads.file.size)  # bytes decoded into memory): may be registered
        stage(pool, src, dst, done, read, mapping)
        return True


class Moves:
    """The moves of one file's regions into their targets, and the choice between them.

    Args:
        mapping: the file's mapping, whose views the sources are, or the file itself where it has
            no mapping (its sources are placeholders: reading/fetches.py); None: sources are in
            memory, only copies and staging without reads apply.
        read: allow :class:`DirectRead` for CPU targets (a caller whose ``done`` may run late).
        ranges: the (offset, length) of the regions that will be moved, for the cache probe and the
            readahead of a cold file.
        pool_for: the staging ring of a device (None: no accelerator targets here).
        stage_all: stage CPU targets too (tests of the pipeline on a machine without an accelerator).
    """

    def __init__(self, mapping: MappedFile | StoredFile | None, *, read: bool = True,
                 ranges: list[tuple[int, int]] = (),  # type: ignore[assignment]
                 pool_for: Callable[[torch.device], StagingPool] | None = None, stage_all: bool = False) -> None:
        self.copy = MappedCopy()
        self.reads: DirectReads | None = None
        self.fetches: FetchReads | None = None
        self.direct: DirectRead | Fetched | None = None
        if isinstance(mapping, StoredFile):
            from .fetches import FetchReads

            self.fetches = FetchReads(mapping)
            self.direct = Fetched(self.fetches) if read else None
        elif mapping is not None:
            self.reads = DirectReads(mapping, enabled=read, ranges=ranges)
            self.direct = DirectRead(self.reads) if self.reads.enabled else None
        self.staged = Staged(pool_for, self.reads or self.fetches) if pool_for is not None else None
        self.stage_all = stage_all
        # CPU targets staged too: the tests' switches, set before a load, asked once a file (not once a target)
        self._stage_cpu = stage_all or (self.staged is not None and stage_cpu_targets())

    def strategy(self, dst: torch.Tensor) -> Move:
        """The strategy for a target: staged for accelerators, else a direct read where reads are on, else a copy."""
        # needs_staging(dst), without the device object dst.device makes (0.8 us)
        if self.staged is not None and (self._stage_cpu or not dst.is_cpu):
            return self.staged
        return self.direct if self.direct is not None else self.copy

    def move(self, src: torch.Tensor, dst: torch.Tensor, label: Label, done: Done) -> Move:
        """Move ``src`` into ``dst`` by :meth:`strategy` (a copy where it declines); return the move that took it."""
        m = self.strategy(dst)
        if m.take(src, dst, label, done):
            return m
        if self.fetches is not None:
            from .fetches import is_placeholder  # imported with FetchReads

            if is_placeholder(src):
                src = self.fetches.materialize(src, label())
        self.copy.take(src, dst, label, done)
        return self.copy

    def finish(self) -> None:
        """Run the direct reads queued (each target's ``done`` follows its read)."""
        for reads in (self.reads, self.fetches):
            if reads is not None:
                for done, _ in reads.run():
                    done()

    def close(self, *, ok: bool) -> None:
        """Seal the staging pools this file's moves used (their reads run now, or after an error are dropped)
        before the file closes, then release the reads' descriptor."""
        try:
            if self.staged is not None:
                for device in self.staged.devices:
                    self.staged.pool_for(device).seal(run=ok)
        finally:
            if self.reads is not None:
                self.reads.close()


def close_all(moves: Iterable[Moves], *, ok: bool) -> None:
    """:meth:`Moves.close` each of ``moves``, all of them even where one raises (a read's error coming out of
    its pool's seal); then raise the first error."""
    error: BaseException | None = None
    for m in moves:
        try:
            m.close(ok=ok)
        except BaseException as e:  # noqa: BLE001 - raised again below, once every file is closed
            error = error or e
            ok = False  # the load failed: later pools drop what they hold
    if error is not None:
        raise error
