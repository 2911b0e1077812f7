"""The parts of the staging ring (io/staging.py): its buffers, its filler thread and its device side.

- :class:`Slot`: one buffer of the ring and everything that rides on it until its copies
  are waited for (the filler's future, the copies' event, the ``done`` callbacks, the
  registered windows its copies read);
- :class:`Ring`: the buffers in the order they are taken, and the waits for them;
- :class:`Filler`: the one thread that fills buffers and issues their copies, in the
  order the caller leaves them;
- :class:`DeviceSide`: the side stream the copies run on, ordered after the caller's
  stream, and the event recorded after each buffer's copies; on the CPU, or a device
  module without streams, copies are synchronous and there is no event;
- :class:`Gather`: a fill from a CPU source rather than from a file.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

import torch

__all__ = ["Slot", "Ring", "Filler", "DeviceSide", "Gather"]


class Slot:
    """One buffer of the ring, and what rides on it until its copies have completed and been waited for."""

    __slots__ = ("buf", "sealed", "event", "done", "held", "blocks")

    def __init__(self, nbytes: int, pin: bool) -> None:
        self.buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        self.sealed: Future[None] | None = None  # its fills and copies, on the filler
        self.event: Any = None  # recorded by the filler after its copies
        self.done: list[Callable[[], None]] = []  # callbacks, run once its copies have completed
        self.held: list[tuple[Any, torch.Tensor]] = []  # (registered window, source) its copies read
        self.blocks = 0  # blocks packed into it, over the pool's life

    def settle(self) -> BaseException | None:
        """Wait for the filler's work on this buffer and for its copies; the fill's error, if any."""
        fut, self.sealed = self.sealed, None
        err = fut.exception() if fut is not None else None
        ev, self.event = self.event, None
        if ev is not None:
            ev.synchronize()
        return err

    def sealed_wait(self) -> BaseException | None:
        """Wait for the filler's work on this buffer (not for its copies); its error, if any."""
        return self.sealed.exception() if self.sealed is not None else None


class Ring:
    """The buffers, taken in turn; a buffer is taken again only once its previous copies have completed.

    ``release(handle)`` gives back a registered window once the copies reading it have completed;
    the caller's waits add to ``stats["wait_s"]``.
    """

    def __init__(self, count: int, nbytes: int, pin: bool, stats: dict[str, Any],
                 release: Callable[[Any], None]) -> None:
        self.slots = [Slot(nbytes, pin) for _ in range(count)]
        self.order: list[int] = []  # buffers holding copies not yet waited for, oldest first
        self.max_in_use = 0  # the most buffers in use at once
        self._next = 0
        self._stats, self._release = stats, release

    def take(self) -> int:
        """The next buffer, once its previous copies (and every older buffer's) are done and their callbacks run."""
        i = self._next
        self._next = (i + 1) % len(self.slots)
        if i in self.order:
            self.wait_through(i)
        self.order.append(i)
        self.max_in_use = max(self.max_in_use, len(self.order))
        return i

    def wait_through(self, i: int) -> None:
        """Wait for buffer ``i``'s copies and those of every buffer before it, running their callbacks; a fill's
        error is raised (the buffers after it are left to :meth:`settle_all`)."""
        t0 = time.perf_counter()
        try:
            while self.order:
                j = self.order.pop(0)
                err = self._settle(j)
                callbacks, self.slots[j].done = self.slots[j].done, []
                if err is not None:
                    raise err
                for cb in callbacks:
                    cb()
                if j == i:
                    return
        finally:
            self._stats["wait_s"] += time.perf_counter() - t0

    def wait_fills(self) -> BaseException | None:
        """Wait until the filler has finished with every buffer handed to it (not for their copies); the first
        fill error, if any."""
        errors = [e for e in (self.slots[i].sealed_wait() for i in self.order) if e is not None]
        return errors[0] if errors else None

    def settle_all(self, side: DeviceSide, *, commit: bool) -> None:
        """Wait for everything in flight; then run the callbacks if ``commit`` and no fill failed, else raise
        the first fill error (when committing)."""
        order, self.order = self.order, []
        errors = [e for e in (self._settle(i) for i in order) if e is not None]
        side.synchronize()
        for i in order:
            callbacks, self.slots[i].done = self.slots[i].done, []
            if commit and not errors:
                for cb in callbacks:
                    cb()
        if commit and errors:
            raise errors[0]

    def _settle(self, i: int) -> BaseException | None:
        slot = self.slots[i]
        try:
            return slot.settle()
        finally:
            held, slot.held = slot.held, []
            for handle, _src in held:
                self._release(handle)


class Gather:
    """A fill from a CPU source (which may be a strided, narrowed region of a stored chunk, or memory)."""

    __slots__ = ("piece",)

    def __init__(self, piece: torch.Tensor) -> None:
        self.piece = piece

    def __call__(self, staged: torch.Tensor, start: int, nbytes: int) -> None:
        staged.view(self.piece.dtype).view(self.piece.shape).copy_(self.piece)


class Filler:
    """The pool's one filler thread: buffers are filled, and their copies issued, in the order they are left.

    Its own thread, not one of the reader threads that the fills share out to (a task of that pool
    waiting for others of it could wait for ever); made again in a forked child, which has no threads."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._pid = 0

    def submit(self, fn: Callable[..., None], *args: Any) -> Future[None]:
        if self._pool is None or self._pid != os.getpid():
            self._pool, self._pid = ThreadPoolExecutor(1, thread_name_prefix="mmapckpt-stage"), os.getpid()
        return self._pool.submit(fn, *args)

    def close(self) -> None:
        if self._pool is not None and self._pid == os.getpid():
            self._pool.shutdown(wait=True)
        self._pool = None


class DeviceSide:
    """Where the copies run: a side stream of ``device`` ordered after the caller's stream, or, on the CPU (and
    devices whose module has no streams), synchronous copies."""

    def __init__(self, device: torch.device) -> None:
        self.mod: Any = torch.get_device_module(device) if device.type != "cpu" else None
        has_streams = self.mod is not None and hasattr(self.mod, "Stream") and hasattr(self.mod, "stream")
        self.device = device
        self.stream: Any = self.mod.Stream(device=device) if has_streams else None
        self.caller: Any = None  # the caller's stream at begin()

    def begin(self) -> None:
        """Order the caller's current stream (where the destinations were made) before the copies."""
        if self.stream is not None:
            self.caller = self.mod.current_stream(self.device)
            self.stream.wait_stream(self.caller)

    def issue(self, copies: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
        """Issue ``(target, source)`` copies (from the filler thread); the event their completion records, if any."""
        if self.stream is None:
            for target, src in copies:
                target.copy_(src)
            return None
        if self.caller is not None:
            # What the caller queued before it left this buffer (targets made from memory freed under its
            # kernels, casts of earlier items) comes first: recorded now, after the buffer was packed.
            self.stream.wait_stream(self.caller)
        with self.mod.stream(self.stream):
            for target, src in copies:
                target.copy_(src, non_blocking=True)
        return self.stream.record_event()

    def synchronize(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()
