"""Device-to-host staging for the writer: copies run ahead of writing, in bounded pinned memory.

Tensors already on the CPU pass through untouched (the writer reads their memory
directly). For tensors on an accelerator, up to ``budget`` bytes of non-blocking
copies into pinned host buffers are issued on a side stream ahead of the one being
written, so the transfer of the next tensors overlaps the write of this one.
"""

from __future__ import annotations

import math
import weakref
from collections import deque
from typing import Any, Callable, Iterable, Iterator

import torch

__all__ = ["stage_to_host", "DEFAULT_BUDGET", "HostBuffer", "pin_pages", "DeviceCopies"]

DEFAULT_BUDGET = 64 << 20


class _Staged:
    __slots__ = ("item", "host", "event", "nbytes", "source")

    def __init__(self, item: Any, host: torch.Tensor, event: Any = None, source: Any = None) -> None:
        self.item, self.host, self.event, self.source = item, host, event, source
        self.nbytes = host.nbytes if event is not None else 0


class _Streams:
    """One side stream per accelerator device, made on first use."""

    def __init__(self) -> None:
        self._by_device: dict[torch.device, Any] = {}

    def copy_to_pinned(self, t: torch.Tensor) -> tuple[torch.Tensor, Any]:
        mod = torch.get_device_module(t.device)
        stream = self._by_device.get(t.device)
        if stream is None:
            stream = self._by_device[t.device] = mod.Stream(device=t.device)
        stream.wait_stream(mod.current_stream(t.device))  # the producer's work on t comes first
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        with mod.stream(stream):
            host.copy_(t, non_blocking=True)
            event = mod.Event()
            event.record(stream)
        return host, event


def stage_to_host(items: Iterable[Any], resolve: Callable[[Any], torch.Tensor],
                  budget: int = DEFAULT_BUDGET) -> Iterator[tuple[Any, torch.Tensor]]:
    """Yield ``(item, tensor on the CPU)`` in order, with device copies running ahead.

    At most ``budget`` bytes of pinned buffers are in flight (one tensor larger than
    the budget is staged alone). The source tensor is kept referenced until its copy
    has completed, so its device memory cannot be reused under the copy.
    """
    streams = _Streams()
    pending: deque[_Staged] = deque()
    inflight = 0
    source = iter(items)
    exhausted = False
    while True:
        # Run ahead only while device copies are in flight: CPU tensors gain nothing from it.
        while not exhausted and (not pending or (inflight < budget and pending[-1].event is not None)):
            try:
                item = next(source)
            except StopIteration:
                exhausted = True
                break
            t = resolve(item)
            if t.requires_grad:
                t = t.detach()
            if t.device.type == "cpu":
                if not pending:  # nothing ahead of it: handed over as it is
                    yield item, t
                    t = None  # not held while the next one is resolved (a conversion reads one at a time)
                    continue
                staged = _Staged(item, t)
            else:
                host, event = streams.copy_to_pinned(t)
                staged = _Staged(item, host, event, t)
            pending.append(staged)
            inflight += staged.nbytes
        if not pending:
            return
        s = pending.popleft()
        if s.event is not None:
            s.event.synchronize()
        inflight -= s.nbytes
        yield s.item, s.host


# ---------------------------------------------------------------------------- whole-state-dict staging
#: Host buffers for device tensors are page-aligned and padded to whole pages, so that registering one
#: with the CUDA driver pins exactly its own pages and never a page another allocation shares.
_PAGE = 4096


class HostBuffer:
    """Host memory for one staged tensor, and the tensors handed out over it.

    ``target`` is what copies go into. ``hand_out()`` returns a tensor over the same memory
    but with a storage of its own (through numpy), so the life of that storage, which every
    view and slice of the tensor shares, says whether anything still uses the memory:
    ``in_use()``. A weak reference to a tensor would not: a slice of it lets the tensor go.

    For a CUDA tensor (``pinned_for`` a CUDA device) the memory is page-aligned, padded to whole
    pages and registered with the driver (``cudaHostRegister``), so exactly the staged bytes are
    page-locked, where ``pin_memory=True`` (the caching host allocator) rounds each block up to
    a power of two, up to twice the state dict; for another accelerator it comes from
    ``pin_memory=True``; for None it is plain pageable memory.
    """

    __slots__ = ("shape", "dtype", "pinned_for", "target", "_array", "_handed")

    def __init__(self, shape: torch.Size, dtype: torch.dtype, pinned_for: torch.device | None) -> None:
        self.shape, self.dtype, self.pinned_for = torch.Size(shape), dtype, pinned_for
        raw = _allocate(dtype.itemsize * math.prod(shape), pinned_for)
        self.target = raw.view(dtype).view(shape)
        self._array = raw.numpy()
        self._handed: list[weakref.ref[torch.UntypedStorage]] = []

    def fits(self, t: torch.Tensor, pinned_for: torch.device | None) -> bool:
        """Whether ``t`` can be staged here (same shape, dtype and page-locking)."""
        return self.shape == t.shape and self.dtype == t.dtype and self.pinned_for == pinned_for

    def hand_out(self) -> torch.Tensor:
        """A tensor over the memory, watched by ``in_use``."""
        t = torch.from_numpy(self._array)
        self._handed.append(weakref.ref(t.untyped_storage()))
        return t.view(self.dtype).view(self.shape)

    def in_use(self) -> bool:
        """Whether any tensor handed out (or a view of one) is still alive."""
        self._handed = [r for r in self._handed if r() is not None]
        return bool(self._handed)


def _allocate(nbytes: int, pinned_for: torch.device | None) -> torch.Tensor:
    """``nbytes`` of host memory as a 1-D uint8 tensor (see HostBuffer)."""
    if pinned_for is None or nbytes == 0:
        return torch.empty(nbytes, dtype=torch.uint8)
    if pinned_for.type != "cuda":
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    from torch.cuda import _pin_memory_utils as pins  # what DCP's own stager registers with

    padded = -(-nbytes // _PAGE) * _PAGE
    raw = torch.empty(padded + _PAGE, dtype=torch.uint8)
    skip = -raw.data_ptr() % _PAGE
    pin_pages(raw.untyped_storage(), skip, padded, pins.pin_memory, pins.unpin_memory)
    return raw[skip:skip + nbytes]


def pin_pages(storage: torch.UntypedStorage, offset: int, nbytes: int,
              pin: Callable[[int, int], None], unpin: Callable[[int], None]) -> None:
    """``pin(address, nbytes)`` now, ``unpin(address)`` when ``storage``'s memory is freed.

    The Python storage object lives exactly as long as the memory (PyTorch preserves it
    while any tensor refers to the storage), so a finalizer on it unregisters the pages
    only once the last tensor over them is gone, and never after the CUDA context is.
    """
    address = storage.data_ptr() + offset
    pin(address, nbytes)
    finalizer = weakref.finalize(storage, unpin, address)
    finalizer.atexit = False


class DeviceCopies:
    """Non-blocking device-to-host copies on one side stream per device, and one wait for them all.

    A side stream is made once per device and kept for later rounds. In each round, before its
    first copy, it waits for the device's current stream (the producer's work on the source
    comes first). ``synchronize`` returns once every byte issued in the round is on the host;
    the caller keeps the sources alive until then.
    """

    def __init__(self) -> None:
        self._streams: dict[torch.device, Any] = {}
        self._round: set[torch.device] = set()

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Issue ``dst.copy_(src, non_blocking=True)`` on ``src``'s device's side stream."""
        mod = torch.get_device_module(src.device)
        stream = self._streams.get(src.device)
        if stream is None:
            stream = self._streams[src.device] = mod.Stream(device=src.device)
        if src.device not in self._round:
            stream.wait_stream(mod.current_stream(src.device))
            self._round.add(src.device)
        with mod.stream(stream):
            dst.copy_(src, non_blocking=True)

    def synchronize(self) -> None:
        """Wait for every copy issued since the last call (one synchronize per device used)."""
        for device in self._round:
            self._streams[device].synchronize()
        self._round.clear()

    def close(self) -> None:
        """Wait for anything in flight and let the streams go."""
        self.synchronize()
        self._streams.clear()
