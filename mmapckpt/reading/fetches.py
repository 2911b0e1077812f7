"""Reading regions of a file that has no mapping (an object) straight into their targets, in batches.

On a medium without mappings (``StoredFile.mapping`` None: object stores) a chunk cannot be a
view. Instead, where a reader will move a chunk into a target (``dcp.load``, ``load_into``, the
accelerator stager), :func:`placeholder` stands for it: a tensor on the meta device, with the
chunk's dtype and shape and no memory, that remembers where the chunk lies in the file. It is
narrowed as a view would be, and :class:`FetchReads` turns the narrowed region into reads of
exactly its bytes:

- into a contiguous CPU target of its dtype, the bytes are read straight into the target's
  memory; these reads are gathered while the plan is walked and run together at the end of
  the file (:meth:`FetchReads.run`, ``StoredFile.read_batch``: on an object store, ranged GETs
  in parallel, neighbours joined, long ones split);
- into a staging buffer (accelerator targets), by :meth:`FetchReads.reader_for`;
- anything else (a strided region, another dtype) is read into memory first
  (:meth:`FetchReads.materialize`: the region's span, one read) and copied.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..storage.base import StoredFile

__all__ = ["placeholder", "is_placeholder", "FetchReads"]

_AT = "_mmapckpt_file_offset"


def placeholder(offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A meta tensor standing for the chunk of ``dtype`` and ``shape`` stored contiguously at ``offset``."""
    t = torch.empty(shape, dtype=dtype, device="meta")
    setattr(t, _AT, offset)
    return t


def is_placeholder(t: torch.Tensor) -> bool:
    """Whether ``t`` is a placeholder or a view of one (its bytes are still in the file)."""
    return t.is_meta and _origin(t) is not None


def _origin(t: torch.Tensor) -> int | None:
    base = t._base if t._base is not None else t
    return getattr(base, _AT, None)


def _span(src: torch.Tensor) -> tuple[int, int]:
    """(file offset of the first byte, bytes up to the end of the last element) of placeholder view ``src``."""
    at = _origin(src)
    assert at is not None, "not a placeholder"
    size = src.element_size()
    last = sum((n - 1) * s for n, s in zip(src.shape, src.stride())) if src.numel() else -1
    return at + src.storage_offset() * size, (last + 1) * size


class FetchReads:
    """Regions of one unmapped file (placeholder views) read into targets (see the module docstring)."""

    def __init__(self, stored: StoredFile) -> None:
        self.stored = stored
        self.jobs: list[tuple[int, Any, Any, torch.Tensor, str]] = []  # (offset, buffer, token, target, label)

    def take(self, src: torch.Tensor, target: torch.Tensor, token: Any, label: str) -> bool:
        """Queue the read of placeholder view ``src`` straight into ``target``, if its bytes can go there as
        they lie (contiguous, same dtype, a CPU target); ``token`` comes back from :meth:`run`."""
        if not (is_placeholder(src) and target.device.type == "cpu" and target.dtype == src.dtype and src.numel()
                and src.is_contiguous() and target.is_contiguous() and not target.is_conj() and not target.is_neg()):
            return False
        offset, _ = _span(src)
        self.jobs.append((offset, target.reshape(-1).view(torch.uint8).numpy(), token, target, label))
        return True

    def reader_for(self, src: torch.Tensor, label: str | None = None) -> Callable[[torch.Tensor, int, int], None] | None:
        """For the staging pool: a function reading ``src``'s bytes into a staging buffer, or None where
        ``src`` is not contiguous in the file."""
        if not (is_placeholder(src) and src.numel() and src.is_contiguous()):
            return None
        return _StoredRead(self.stored, _span(src)[0], label)

    def materialize(self, src: torch.Tensor, label: str | None = None) -> torch.Tensor:
        """``src``'s values in a new contiguous tensor (``src`` itself where it is not a placeholder): a
        contiguous region in one read; a strided one as its contiguous runs, read together (neighbouring
        runs are joined into one request by the medium), or its whole span where the runs are too many."""
        if not is_placeholder(src):
            return src
        out = torch.empty(src.shape, dtype=src.dtype)
        if not src.numel():
            return out
        flat = out.reshape(-1).view(torch.uint8).numpy()
        offset, length = _span(src)
        if src.is_contiguous():
            self.stored.read_into(offset, flat, entry=label)
            return out
        runs = _runs(src, offset)
        if runs is None:
            buf = torch.empty(length, dtype=torch.uint8)
            self.stored.read_into(offset, buf.numpy(), entry=label)
            out.copy_(buf.view(src.dtype).as_strided(src.shape, src.stride()))
            return out
        step = len(flat) // len(runs)
        self.stored.read_batch([(at, flat[i * step:(i + 1) * step]) for i, at in enumerate(runs)], entry=label)
        return out

    def run(self) -> list[tuple[Any, torch.Tensor]]:
        """Read every queued region (together: ``StoredFile.read_batch``); return (token, target) of each."""
        if not self.jobs:
            return []
        jobs, self.jobs = self.jobs, []
        self.stored.read_batch([(o, b) for o, b, _, _, _ in jobs], entry=jobs[0][4] if len(jobs) == 1 else None)
        return [(token, target) for _, _, token, target, _ in jobs]


#: A strided region is read as its contiguous runs when there are at most this many.
_MAX_RUNS = 1 << 16


def _runs(src: torch.Tensor, offset: int) -> list[int] | None:
    """The file offsets of the contiguous runs of placeholder view ``src`` (which starts at ``offset``), in
    row-major order, each as long as the largest block of trailing dimensions laid out contiguously; None
    where they are more than ``_MAX_RUNS``."""
    size = src.element_size()
    expected, k = 1, src.dim()
    while k > 0 and (src.shape[k - 1] == 1 or src.stride(k - 1) == expected):
        expected *= src.shape[k - 1]
        k -= 1
    count = 1
    for n in src.shape[:k]:
        count *= n
    if count > _MAX_RUNS:
        return None
    starts = torch.zeros((), dtype=torch.int64)
    for d in range(k):  # every combination of the outer indices, row-major
        starts = (starts.unsqueeze(-1) + torch.arange(src.shape[d]) * src.stride(d)).reshape(-1)
    return (offset + starts.reshape(-1) * size).tolist()


class _StoredRead:
    """A staging reader (``io.staging.Reader``) of a contiguous region of an unmapped file."""

    __slots__ = ("stored", "offset", "label")
    parallel = False  # the medium parallelizes one read itself (an object store's ranged GETs)

    def __init__(self, stored: StoredFile, offset: int, label: str | None) -> None:
        self.stored, self.offset, self.label = stored, offset, label

    def __call__(self, staged: torch.Tensor, start: int, nbytes: int) -> None:
        self.stored.read_into(self.offset + start, staged.numpy()[:nbytes], entry=self.label)
