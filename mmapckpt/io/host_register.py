"""Mapped file pages registered with the CUDA driver, in bounded windows: copies with no CPU copy.

A host-to-device copy is asynchronous, and run by the copy engine at the link's speed, only
from page-locked host memory. Pinned staging buffers get there at the price of one CPU copy
out of the page cache. ``cudaHostRegister(ptr, n, cudaHostRegisterReadOnly)`` page-locks the
mapped file's own pages instead (the page cache's pages, shared with every other process
mapping the file), after which the copy engine reads them directly.

Why read-only: the mappings of :mod:`mmapckpt.io.mapped` are MAP_PRIVATE and writable, and a
writable registration pins its pages for writing, which breaks copy-on-write: the kernel
would copy every page into anonymous memory, the opposite of the aim. ``cudaHostRegisterReadOnly``
(flag 8, CUDA 11.1+, where the device attribute ``cudaDevAttrHostRegisterReadOnlySupported``,
113, is 1) pins the page-cache pages as they are. Pinned pages cannot be evicted, so the
registry below bounds them (``budget_bytes``) and unregisters them when asked. Registering
faults in every page not yet mapped, so on a cold file it is a synchronous, fault-driven
read: registration suits cached files. Not yet seen on a GPU (tests/gpu/test_cuda_register.py
will tell): that the driver pins a MAP_PRIVATE file mapping's page-cache pages read-only as
documented, rather than refusing them.

What torch 2.13 exposes (torch/csrc/cuda/shared/cudart.cpp, ``torch.cuda.cudart()``):
``cudaHostRegister(ptr, size, flags)`` and ``cudaHostUnregister(ptr)`` (both release the
GIL and return a ``cudaError`` whose ``int`` is the code), ``cudaGetErrorString``,
``cudaMemGetInfo``, ``cudaStreamCreate/Destroy``, ``cudaProfilerStart/Stop``; no
``cudaDeviceGetAttribute`` and no ``cudaGetLastError``. Both are needed, so
:func:`cuda_host_driver` takes them by ctypes from the libcudart that torch itself loaded
(found in /proc/self/maps): the runtime's per-thread "last error" lives in that library
instance, and a failed ``cudaHostRegister`` leaves its code there, where torch's next
``cudaGetLastError`` check on the same thread (every kernel launch) would raise it as if
the launch had failed; so a refusal is cleared at once. Where no libcudart is mapped (a
build linking it statically) the capability is probed by registering one page instead, and
a refusal cannot be cleared: the reason says so.

How torch copies from such memory (aten/src/ATen/native/cuda/Copy.cu, ``copy_kernel_cuda``):
a CPU->CUDA ``copy_(non_blocking=True)`` of a contiguous same-dtype source calls
``cudaMemcpyAsync`` on the raw pointer, whatever allocated it; the driver sees registered
pages and runs the copy asynchronously (unregistered pageable memory would be copied
synchronously through a driver bounce buffer). Then it calls the caching host allocator's
``record_event(ptr, ctx, stream)``, which finds no block of its own for a foreign pointer
and does nothing (its return value is ignored): **nothing keeps the registration or the
mapping alive for the copy**. The caller must keep the handle (and the mapping) until the
copy has completed (an event recorded after it, synchronised) and only then release it.
``Tensor.is_pinned()`` of a view of registered pages is True: it asks
``cudaPointerGetAttributes`` (CUDAHooks::isPinnedPtr), which reports registered memory as
``cudaMemoryTypeHost``. A non-contiguous or dtype-converting copy goes through a temporary
and is not a direct read.

The registry: a window is a tile of ``window_bytes`` aligned in the address space and clipped
to its mapping's page-rounded bounds, so tiles never overlap (the driver refuses overlapping
registrations) and a range is covered by the same tiles whoever asks. ``acquire`` registers
the missing tiles and counts users; ``release`` unregisters a tile once unused, or keeps it
(``keep=True``, least recently used evicted first) while the budget allows, for a server that
loads the same files again. A driver refusal disables the registry (the reason kept) and the
caller falls back to staging. Driver calls run under the registry's lock: the driver
serialises registrations anyway (they take the process's memory-map lock), and one lock
keeps the books simple.
"""

from __future__ import annotations

import os
import threading
import time
import warnings
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from .sizes import parse_size
from .host_drivers import (DEFAULT_WINDOW_BYTES, PAGE, CudaHostDriver, HostDriver, HostRegisterError,
                           RecordingDriver, cuda_host_driver)

__all__ = ["registry_from_env", "REGISTER_ENV", "HostRegistry", "RegisteredRange", "RegistryStats", "window_spans", "HostDriver", "HostRegisterError", "CudaHostDriver",
           "cuda_host_driver", "RecordingDriver", "PAGE", "DEFAULT_WINDOW_BYTES"]


@dataclass(frozen=True)
class RegisteredRange:
    """What :meth:`HostRegistry.acquire` hands out: the tiles covering ``[ptr, ptr + nbytes)``.

    Attributes:
        ptr, nbytes: the range asked for.
        tiles: ``(start, end)`` of each registered tile covering it, in address order.
        token: the registry's name for this handle.
    """

    ptr: int
    nbytes: int
    tiles: tuple[tuple[int, int], ...]
    token: int


@dataclass(frozen=True)
class RegistryStats:
    """The registry's counters (the pipeline reports them)."""

    registered_bytes: int
    peak_bytes: int
    registrations: int
    unregistrations: int
    register_s: float
    unregister_s: float
    refused: int
    disabled: str | None


@dataclass(eq=False)
class _Tile:
    start: int
    end: int
    lo: int  # the mapping's first address
    users: int = 0


class HostRegistry:
    """Registered windows of mappings, refcounted, bounded by ``budget_bytes``; thread-safe.

    Args:
        budget_bytes: the most bytes registered at any time.
        driver: the :class:`HostDriver` to register with.
        window_bytes: the tile size, a positive multiple of the page size.
        keep: keep unused tiles registered (least recently used evicted first) while the
            budget allows, for repeated loads of the same files; else unregister them at once.
    """

    def __init__(self, budget_bytes: int, driver: HostDriver, *, window_bytes: int = DEFAULT_WINDOW_BYTES,
                 keep: bool = False) -> None:
        if window_bytes <= 0 or window_bytes % PAGE:
            raise ValueError(f"window_bytes must be a positive multiple of the page size ({PAGE}), not {window_bytes}")
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must not be negative, not {budget_bytes}")
        self.budget_bytes, self.window_bytes, self.keep = budget_bytes, window_bytes, keep
        self._driver = driver
        self._lock = threading.Lock()
        self._tiles: dict[int, _Tile] = {}  # by start address
        self._windows: dict[int, set[int]] = {}  # window index -> starts of its tiles (one per mapping)
        self._idle: OrderedDict[int, _Tile] = OrderedDict()  # users == 0, oldest release first
        self._live: dict[int, list[_Tile]] = {}  # handle token -> the tile objects it holds
        self._next_token = 0
        self._bytes = self._peak = self._regs = self._unregs = self._refused = 0
        self._reg_s = self._unreg_s = 0.0
        self._disabled: str | None = None

    # -- the public calls ------------------------------------------------------------------

    def acquire(self, ptr: int, nbytes: int, bounds: tuple[int, int]) -> RegisteredRange | None:
        """Register (or reuse) the tiles covering ``[ptr, ptr + nbytes)`` of the mapping ``bounds``.

        Args:
            ptr: the first byte's address.
            nbytes: how many bytes (0 gives an empty handle).
            bounds: ``(lo, hi)``, the mapping's first address (page-aligned) and its end; tiles
                reach up to ``hi`` rounded up to a page (a mapping covers whole pages).

        Returns:
            A handle to pass to :meth:`release` once every copy from the range has completed;
            None where the tiles would exceed the budget (wait for older copies and release
            them, or stage instead) or the registry is disabled or closed.

        Raises:
            ValueError: the range is outside ``bounds``, ``lo`` is not page-aligned, or a tile of
                another mapping overlaps it (a mapping closed without :meth:`forget`).
        """
        lo, hi = bounds
        if lo % PAGE or nbytes < 0 or ptr < lo or ptr + nbytes > hi:
            raise ValueError(f"range [{ptr:#x}, +{nbytes}) is not inside the page-aligned mapping [{lo:#x}, {hi:#x})")
        with self._lock:
            if self._disabled is not None:
                return None
            spans = self._spans(ptr, nbytes, lo, _round_up(hi))
            missing = [s for s in spans if s[0] not in self._tiles]
            if not self._make_room(sum(e - s for s, e in missing), {s for s, _ in spans}):
                self._refused += 1
                return None
            if self._disabled is not None:  # an eviction's unregistration was refused
                return None
            done: list[_Tile] = []
            for start, end in missing:
                tile = self._register(start, end, lo)
                if tile is None:  # refused: the registry is now disabled
                    for t in done:
                        self._unregister(t)
                    return None
                done.append(tile)
            held = [self._tiles[start] for start, _ in spans]
            for tile in held:
                tile.users += 1
                self._idle.pop(tile.start, None)
            token, self._next_token = self._next_token, self._next_token + 1
            self._live[token] = held
            return RegisteredRange(ptr, nbytes, tuple(spans), token)

    def release(self, handle: RegisteredRange) -> None:
        """Give back a handle once every copy from its range has completed.

        Tiles left unused are unregistered, or kept in ``keep`` mode. A handle whose tiles
        were dropped by :meth:`forget` or :meth:`close` is accepted and changes nothing.

        Raises:
            ValueError: the handle was released already.
        """
        with self._lock:
            held = self._live.pop(handle.token, None)
            if held is None:
                raise ValueError(f"handle {handle.token} was released already (or is not this registry's)")
            for tile in held:
                if self._tiles.get(tile.start) is not tile:  # forgotten, or closed
                    continue
                tile.users -= 1
                if tile.users == 0:
                    if self.keep and self._disabled is None:
                        self._idle[tile.start] = tile
                    else:
                        self._unregister(tile)

    def forget(self, bounds: tuple[int, int]) -> None:
        """Unregister every tile of the mapping ``bounds``: call it before the mapping is closed.

        A registered range must never outlive its mapping (the next mapping at those addresses
        would overlap it). Handles on these tiles stay valid to release and hold nothing; the
        copies from them must have completed.
        """
        lo, hi = bounds[0], _round_up(bounds[1])
        with self._lock:
            for tile in [t for t in self._tiles.values() if t.start < hi and t.end > lo]:
                self._unregister(tile)

    def close(self) -> None:
        """Unregister everything; later acquires return None, releases do nothing. Idempotent."""
        with self._lock:
            for tile in list(self._tiles.values()):
                self._unregister(tile)
            if self._disabled is None:
                self._disabled = "closed"

    def stats(self) -> RegistryStats:
        """The counters: bytes registered now and at peak, calls made, seconds in the driver."""
        with self._lock:
            return RegistryStats(self._bytes, self._peak, self._regs, self._unregs, self._reg_s,
                                 self._unreg_s, self._refused, self._disabled)

    @property
    def disabled(self) -> str | None:
        """Why the registry hands out nothing ("closed", or the driver's refusal), or None."""
        return self._disabled

    def __enter__(self) -> HostRegistry:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the books (under the lock) --------------------------------------------------------

    def _spans(self, ptr: int, nbytes: int, lo: int, hi: int) -> list[tuple[int, int]]:
        spans = window_spans(ptr, nbytes, lo, hi, self.window_bytes)
        for start, end in spans:
            for s in self._windows.get(start // self.window_bytes, ()):
                t = self._tiles[s]
                if t.start < end and t.end > start and (t.start, t.end, t.lo) != (start, end, lo):
                    raise ValueError(f"tile [{start:#x}, {end:#x}) overlaps a registration of another mapping "
                                     f"[{t.start:#x}, {t.end:#x}): forget() a mapping's tiles before closing it")
        return spans

    def _make_room(self, need: int, wanted: set[int]) -> bool:
        if need > self.budget_bytes:
            return False
        for tile in [t for s, t in self._idle.items() if s not in wanted]:
            if self._bytes + need <= self.budget_bytes:
                break
            self._unregister(tile)
        return self._bytes + need <= self.budget_bytes

    def _register(self, start: int, end: int, lo: int) -> _Tile | None:
        t0 = time.perf_counter()
        try:
            self._driver.register(start, end - start)
        except HostRegisterError as e:
            self._reg_s += time.perf_counter() - t0
            self._disable(f"registration refused: {e}")
            return None
        self._reg_s += time.perf_counter() - t0
        self._regs += 1
        tile = self._tiles[start] = _Tile(start, end, lo)
        self._windows.setdefault(start // self.window_bytes, set()).add(start)
        self._bytes += end - start
        self._peak = max(self._peak, self._bytes)
        return tile

    def _unregister(self, tile: _Tile) -> None:
        if self._tiles.get(tile.start) is not tile:  # gone already (a refusal dropped the idle tiles)
            return
        del self._tiles[tile.start]
        window = self._windows[tile.start // self.window_bytes]
        window.discard(tile.start)
        if not window:
            del self._windows[tile.start // self.window_bytes]
        self._idle.pop(tile.start, None)
        self._bytes -= tile.end - tile.start
        t0 = time.perf_counter()
        try:
            self._driver.unregister(tile.start)
            self._unregs += 1
        except HostRegisterError as e:
            self._disable(f"unregistration refused: {e}")
        finally:
            self._unreg_s += time.perf_counter() - t0

    def _disable(self, reason: str) -> None:
        if self._disabled is None:
            self._disabled = reason
        while self._idle:  # nothing will reuse them now
            self._unregister(next(iter(self._idle.values())))


def window_spans(ptr: int, nbytes: int, lo: int, hi: int, window: int) -> list[tuple[int, int]]:
    """``(start, end)`` of the tiles covering ``[ptr, ptr + nbytes)``: window-aligned, clipped to ``[lo, hi)``."""
    out, k = [], ptr // window
    while nbytes and k * window < ptr + nbytes:
        out.append((max(k * window, lo), min((k + 1) * window, hi)))
        k += 1
    return out


def _round_up(n: int) -> int:
    return -(-n // PAGE) * PAGE


#: The environment variable that turns on registered copies in the staging pipeline (:func:`registry_from_env`).
REGISTER_ENV = "MMAPCKPT_REGISTER_BYTES"


def registry_from_env(device: Any) -> HostRegistry | None:
    """``MMAPCKPT_REGISTER_BYTES`` (a size: ``1GiB``, ``268435456``; unset or 0: off, the default): for a CUDA
    device, a registry of at most that many bytes of mapped file pages, so that staged loads of cached files
    are copied by the device straight from the page cache (io/host_register.py). Experimental: not yet
    measured on a GPU. Where the driver cannot register read-only, a warning says why and loads stage."""
    text = os.environ.get(REGISTER_ENV, "").strip()
    if text in ("", "0") or device.type != "cuda":
        return None
    try:
        budget = parse_size(text)
    except ValueError as e:
        raise ValueError(f"{REGISTER_ENV}: {e}") from None
    driver, reason = cuda_host_driver(device.index)
    if driver is None:
        warnings.warn(f"{REGISTER_ENV} is set, but the mapped files cannot be registered ({reason}); "
                      "loads stage through pinned buffers instead", RuntimeWarning, stacklevel=3)
        return None
    return HostRegistry(budget, driver, window_bytes=max(PAGE, min(DEFAULT_WINDOW_BYTES, budget // 4 // PAGE * PAGE)))
