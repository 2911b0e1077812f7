"""Drivers that page-lock host ranges for an accelerator: CUDA's, and a recording one for the CPU.

:class:`CudaHostDriver` calls ``cudaHostRegister``/``cudaHostUnregister`` through
``torch.cuda.cudart()``; :func:`cuda_host_driver` checks first that the device can register
read-only (see :mod:`mmapckpt.io.host_register` for why read-only and how torch copies from
such memory). :class:`RecordingDriver` registers nothing and enforces every rule the CUDA
driver does (page-aligned start and size, no overlap with a registered range, unregister
only what is registered, and, where it is told the live mappings, ranges inside one), so
that the registry's bookkeeping is tested, and the benchmark smoke-runs, without a GPU.
"""

from __future__ import annotations

import ctypes
import mmap
import threading
import time
from typing import Protocol

__all__ = ["HostDriver", "HostRegisterError", "CudaHostDriver", "cuda_host_driver", "RecordingDriver",
           "PAGE", "DEFAULT_WINDOW_BYTES", "FLAG_PORTABLE", "FLAG_MAPPED", "FLAG_IO_MEMORY", "FLAG_READ_ONLY"]

PAGE = mmap.PAGESIZE
#: cudaHostRegister flags (driver_types.h).
FLAG_PORTABLE, FLAG_MAPPED, FLAG_IO_MEMORY, FLAG_READ_ONLY = 1, 2, 4, 8
#: 64 MiB a window: no GPU figure exists yet (benchmarks/cuda_register_bench.py measures 32 MiB,
#: 256 MiB and whole files); a window this size is registered ahead of its copy in a few ms if
#: registration runs near the driver's published pinning rates, and wastes little at a file's end.
DEFAULT_WINDOW_BYTES = 64 << 20
_ATTR_HOST_REGISTER_SUPPORTED = 99
_ATTR_HOST_REGISTER_READ_ONLY_SUPPORTED = 113


class HostRegisterError(RuntimeError):
    """The driver refused to register or unregister a host range.

    Attributes:
        code: the driver's error code (0 where none applies).
    """

    def __init__(self, message: str, code: int = 0) -> None:
        super().__init__(message)
        self.code = code


class HostDriver(Protocol):
    """Registers page-aligned host ranges with an accelerator driver."""

    def register(self, ptr: int, nbytes: int) -> None:
        """Page-lock ``nbytes`` at ``ptr`` (both page-aligned); raise HostRegisterError if refused."""

    def unregister(self, ptr: int) -> None:
        """Undo the registration that started at ``ptr``; raise HostRegisterError if refused."""


def _mapped_cudart() -> ctypes.CDLL | None:
    """The libcudart this process already mapped (torch's), or None."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libcudart.so" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    return None


class CudaHostDriver:
    """:class:`HostDriver` over ``torch.cuda.cudart()``'s cudaHostRegister/cudaHostUnregister.

    Args:
        flags: cudaHostRegister flags. Read-only (see :mod:`mmapckpt.io.host_register`) and
            portable by default: without ``cudaHostRegisterPortable`` the pages count as pinned
            only in the context current on the registering thread, and torch's current device
            is per thread (a filler thread sits on device 0 while the copies go to cuda:1).
        libcudart: torch's libcudart by ctypes, to clear a refusal from the runtime's
            last-error slot; None where it is not reachable.
    """

    def __init__(self, flags: int = FLAG_READ_ONLY | FLAG_PORTABLE, libcudart: ctypes.CDLL | None = None) -> None:
        import torch

        self.flags = flags
        self._cudart = torch.cuda.cudart()
        self._lib = libcudart

    def _refused(self, what: str, code: int) -> HostRegisterError:
        if self._lib is not None:
            self._lib.cudaGetLastError()  # torch's next launch check would raise it otherwise
        try:
            text = self._cudart.cudaGetErrorString(self._cudart.cudaError(code))
        except Exception:  # a code the binding's enum does not list
            text = f"CUDA error {code}"
        return HostRegisterError(f"{what} refused: {text} ({code})", code)

    def register(self, ptr: int, nbytes: int) -> None:
        """See :class:`HostDriver`."""
        code = int(self._cudart.cudaHostRegister(ptr, nbytes, self.flags))
        if code:
            raise self._refused(f"cudaHostRegister({ptr:#x}, {nbytes}, flags={self.flags})", code)

    def unregister(self, ptr: int) -> None:
        """See :class:`HostDriver`."""
        code = int(self._cudart.cudaHostUnregister(ptr))
        if code:
            raise self._refused(f"cudaHostUnregister({ptr:#x})", code)


def cuda_host_driver(device: int | None = None) -> tuple[CudaHostDriver | None, str]:
    """A read-only registration driver for ``device``, or None and the reason it cannot be had.

    Args:
        device: the CUDA device index (default: the current one).

    Returns:
        ``(driver, "")`` where CUDA is available and the device supports read-only host
        registration; ``(None, reason)`` otherwise. The capability is read with
        ``cudaDeviceGetAttribute(cudaDevAttrHostRegisterReadOnlySupported)`` from torch's own
        libcudart, or, where that library is not reachable, probed by registering one page.
    """
    import torch

    if not torch.cuda.is_available():
        return None, "no CUDA device is available"
    if torch.version.hip is not None:
        return None, "read-only host registration is a CUDA feature; this is a ROCm build"
    dev = torch.cuda.current_device() if device is None else device
    torch.cuda.init()
    lib = _mapped_cudart()
    if lib is None:
        return _probe(dev)
    for attr, what in ((_ATTR_HOST_REGISTER_SUPPORTED, "host memory registration"),
                       (_ATTR_HOST_REGISTER_READ_ONLY_SUPPORTED, "read-only host registration")):
        value = ctypes.c_int(0)
        code = lib.cudaDeviceGetAttribute(ctypes.byref(value), attr, dev)
        if code:
            lib.cudaGetLastError()
            return None, f"cudaDeviceGetAttribute({attr}) failed with CUDA error {code}"
        if not value.value:
            return None, f"device {dev} ({torch.cuda.get_device_name(dev)}) does not support {what}"
    return CudaHostDriver(libcudart=lib), ""


def _probe(dev: int) -> tuple[CudaHostDriver | None, str]:
    page = mmap.mmap(-1, PAGE)
    ptr = ctypes.addressof(ctypes.c_char.from_buffer(page))
    driver = CudaHostDriver()
    try:
        driver.register(ptr, PAGE)
    except HostRegisterError as e:
        return None, (f"device {dev}: a probe registration was refused ({e}); torch's libcudart is not "
                      "mapped, so the runtime's last error could not be cleared")
    driver.unregister(ptr)
    return driver, ""




class RecordingDriver:
    """A :class:`HostDriver` that registers nothing and checks every rule the CUDA driver enforces.

    A broken rule raises AssertionError (a bug in the caller, not a refusal) and is also kept
    in :attr:`violations`, so that a rule broken on another thread is not lost. ``refuse_after``
    makes the driver refuse (HostRegisterError) every registration after that many.

    Args:
        refuse_after: registrations to accept before refusing; None: never refuse.
        check_mapped: also require every range to lie inside a mapping given to :meth:`mapped`.

    Attributes:
        registered: start -> size of every range registered now.
        violations: the rules broken, in words.
        calls: ("register", ptr, nbytes) and ("unregister", ptr) in order.
    """

    def __init__(self, refuse_after: int | None = None, *, check_mapped: bool = True) -> None:
        self.refuse_after, self.check_mapped = refuse_after, check_mapped
        self.registered: dict[int, int] = {}
        self.violations: list[str] = []
        self.calls: list[tuple] = []
        self.closed = False
        self._mappings: dict[int, int] = {}
        self._lock = threading.Lock()

    def mapped(self, lo: int, hi: int) -> None:
        """Declare the mapping ``[lo, hi)`` live (``hi`` rounded up to a page)."""
        with self._lock:
            self._mappings[lo] = -(-hi // PAGE) * PAGE

    def unmapped(self, lo: int) -> None:
        """Declare the mapping at ``lo`` closed: nothing may be registered in it any more."""
        with self._lock:
            hi = self._mappings.pop(lo)
            self._check(not any(p < hi and p + n > lo for p, n in self.registered.items()),
                        f"mapping [{lo:#x}, {hi:#x}) closed while ranges in it are registered")

    def close(self) -> None:
        """Declare the registry closed: nothing may stay or become registered."""
        with self._lock:
            self.closed = True
            self._check(not self.registered, f"{len(self.registered)} ranges still registered at close")

    def register(self, ptr: int, nbytes: int) -> None:
        """See :class:`HostDriver`."""
        time.sleep(0)  # the CUDA binding releases the GIL here: let other threads run meanwhile
        with self._lock:
            self.calls.append(("register", ptr, nbytes))
            self._check(not self.closed, "registration after close")
            self._check(ptr % PAGE == 0 and nbytes % PAGE == 0 and nbytes > 0,
                        f"range [{ptr:#x}, +{nbytes}) is not whole pages")
            self._check(not any(p < ptr + nbytes and p + n > ptr for p, n in self.registered.items()),
                        f"range [{ptr:#x}, +{nbytes}) overlaps a registered range")
            if self.check_mapped:
                self._check(any(lo <= ptr and ptr + nbytes <= hi for lo, hi in self._mappings.items()),
                            f"range [{ptr:#x}, +{nbytes}) is not inside a live mapping")
            if self.refuse_after is not None and len([c for c in self.calls if c[0] == "register"]) > self.refuse_after:
                raise HostRegisterError(f"cudaHostRegister({ptr:#x}, {nbytes}) refused: out of memory (2)", 2)
            self.registered[ptr] = nbytes

    def unregister(self, ptr: int) -> None:
        """See :class:`HostDriver`."""
        time.sleep(0)
        with self._lock:
            self.calls.append(("unregister", ptr))
            self._check(ptr in self.registered, f"unregister of {ptr:#x}, which is not registered")
            self.registered.pop(ptr, None)

    def covers(self, ptr: int, nbytes: int) -> bool:
        """Whether every byte of ``[ptr, ptr + nbytes)`` is registered now."""
        with self._lock:
            spans = sorted((p, p + n) for p, n in self.registered.items() if p < ptr + nbytes and p + n > ptr)
        at = ptr
        for lo, hi in spans:
            if lo > at:
                return False
            at = max(at, hi)
        return at >= ptr + nbytes

    def _check(self, ok: bool, what: str) -> None:
        if not ok:
            self.violations.append(what)
            raise AssertionError(what)
