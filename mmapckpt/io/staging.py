"""Host-to-accelerator copies through a small, fixed pool of pinned buffers.

Copies to an accelerator are asynchronous only from pinned (page-locked) host
memory; from mapped file pages they are slow and synchronous. So each source
tensor is cut into blocks of at most ``buffer_bytes`` whose bytes are contiguous
in the source (``plan_blocks``); each block is read into the next pinned buffer
and copied to the device with ``non_blocking=True`` on a side stream. Before a
buffer is refilled, the host waits for the event recorded after its last copy,
so with two or more buffers reading the next block overlaps copying the last.
Pinned memory stays ``num_buffers * buffer_bytes`` whatever the checkpoint size.

Stream discipline: the side stream first waits for the current stream (the
destination tensors are allocated on it), and the pool synchronises the side
stream on exit, also when an error interrupts it, before buffers or
destinations can be freed or reused.

On the CPU (``device="cpu"``) the same loop runs synchronously with ordinary
buffers; tests use that to check the block and buffer logic without a GPU.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator

import torch

__all__ = ["Block", "plan_blocks", "StagingPool", "DEFAULT_BUFFER_BYTES", "DEFAULT_NUM_BUFFERS"]

DEFAULT_BUFFER_BYTES = 32 << 20
DEFAULT_NUM_BUFFERS = 3


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


class StagingPool:
    """A pool of ``num_buffers`` (pinned) host buffers that stages copies to ``device``.

    Use as a context manager; leaving it waits for every copy issued.

    Example:
        >>> with StagingPool("cuda") as pool:
        ...     pool.copy(cpu_tensor, cuda_tensor)
    """

    def __init__(self, device: str | torch.device, *, buffer_bytes: int = DEFAULT_BUFFER_BYTES,
                 num_buffers: int = DEFAULT_NUM_BUFFERS, pin: bool | None = None) -> None:
        if num_buffers < 1 or buffer_bytes < 1:
            raise ValueError(f"need num_buffers >= 1 and buffer_bytes >= 1, got {num_buffers}, {buffer_bytes}")
        self.device = torch.device(device)
        accelerated = self.device.type != "cpu"
        pin = accelerated if pin is None else pin
        self.buffer_bytes = buffer_bytes
        self._bufs = [torch.empty(buffer_bytes, dtype=torch.uint8, pin_memory=pin) for _ in range(num_buffers)]
        self._events: list[Any] = [None] * num_buffers
        self._next = 0
        self._mod: Any = torch.get_device_module(self.device) if accelerated else None
        # Devices whose module has no streams get synchronous copies (still through the pool).
        has_streams = accelerated and hasattr(self._mod, "Stream") and hasattr(self._mod, "stream")
        self._stream: Any = self._mod.Stream(device=self.device) if has_streams else None
        #: how many blocks went through each buffer (tests check the rotation)
        self.blocks_per_buffer = [0] * num_buffers

    def __enter__(self) -> StagingPool:
        if self._stream is not None:
            self._stream.wait_stream(self._mod.current_stream(self.device))
        return self

    def __exit__(self, *exc: object) -> None:
        self.synchronize()

    def synchronize(self) -> None:
        """Wait until every copy issued so far has finished."""
        if self._stream is not None:
            self._stream.synchronize()

    def _stream_ctx(self) -> contextlib.AbstractContextManager[Any]:
        return self._mod.stream(self._stream) if self._stream is not None else contextlib.nullcontext()

    def _acquire(self) -> int:
        """The next buffer in turn, once its previous copy has finished."""
        i = self._next
        self._next = (i + 1) % len(self._bufs)
        ev = self._events[i]
        if ev is not None:
            ev.synchronize()
            self._events[i] = None
        return i

    def copy(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Issue the copy of CPU tensor ``src`` into ``dst`` (same shape and dtype, any strides).

        Reading ``src`` (page faults on a mapping) happens here, on the host; the
        device copies run behind it. Call :meth:`synchronize` (or leave the
        ``with`` block) before using ``dst``.
        """
        if src.device.type != "cpu" or src.shape != dst.shape or src.dtype != dst.dtype:
            raise ValueError(f"cannot stage {src.dtype} {list(src.shape)} on {src.device} into "
                             f"{dst.dtype} {list(dst.shape)}")
        src = src.contiguous()
        # as_strided, not reshape: a contiguous tensor may keep a stride != 1 on a size-1 dim
        flat = src.as_strided((src.numel(),), (1,)).view(torch.uint8) if src.numel() else src
        itemsize = src.element_size()
        for b in plan_blocks(tuple(src.shape), itemsize, self.buffer_bytes):
            i = self._acquire()
            staged = self._bufs[i][:b.nbytes]
            staged.copy_(flat[b.start:b.start + b.nbytes])
            target = dst[b.index]
            with self._stream_ctx():
                target.copy_(staged.view(src.dtype).view(target.shape), non_blocking=self._stream is not None)
                if self._stream is not None:
                    self._events[i] = self._stream.record_event()
            self.blocks_per_buffer[i] += 1
