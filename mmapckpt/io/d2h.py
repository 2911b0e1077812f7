"""Device-to-host staging for the writer: copies run ahead of writing, in bounded pinned memory.

Tensors already on the CPU pass through untouched (the writer reads their memory
directly). For tensors on an accelerator, up to ``budget`` bytes of non-blocking
copies into pinned host buffers are issued on a side stream ahead of the one being
written, so the transfer of the next tensors overlaps the write of this one.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable, Iterable, Iterator

import torch

__all__ = ["stage_to_host", "DEFAULT_BUDGET"]

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
