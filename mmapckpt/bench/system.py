"""The benchmark's view of the machine: page-cache control and the physical limits.

Every limit moves the same number of bytes as the checkpoint under test, in the
same run, so that each method can be reported as a fraction of what the memory
and the disk of this machine allow at that moment.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import platform
import time
from typing import Iterable

import torch

__all__ = [
    "CHUNK",
    "files_under",
    "evict",
    "cached_fraction",
    "warm_up",
    "fsync_path",
    "copy_limit",
    "write_limit",
    "cold_read_limit",
    "read_buffer",
    "machine_info",
]

#: I/O size of the sequential limits (the size the FACTS' 64 MB-buffered read used).
CHUNK = 64 << 20
_BLOCK = 4096


def files_under(path: str) -> list[str]:
    """Every regular file of a checkpoint: ``path`` itself or the files below it."""
    if os.path.isfile(path):
        return [path]
    out = []
    for root, _dirs, names in os.walk(path):
        out.extend(os.path.join(root, n) for n in sorted(names))
    return out


def evict(paths: Iterable[str]) -> None:
    """Drop the files' pages from the page cache (after fsync, so none is dirty)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def cached_fraction(paths: Iterable[str]) -> float | None:
    """The fraction of the files' pages in the page cache (``mincore``), or None where it cannot be told.

    ``evict`` cannot report failure (``posix_fadvise`` is advice): a tmpfs keeps every page,
    since the page cache is its storage. Asking afterwards tells a cold read from a warm one.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        mincore = libc.mincore
    except (OSError, AttributeError):
        return None
    page = mmap.PAGESIZE
    cached = total = 0
    for p in paths:
        size = os.path.getsize(p)
        if size == 0:
            continue
        pages = (size + page - 1) // page
        with open(p, "rb") as f:
            mm = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)  # private: writable for ctypes, never written
        try:
            anchor = ctypes.c_char.from_buffer(mm)
            vec = (ctypes.c_ubyte * pages)()
            rc = mincore(ctypes.c_void_p(ctypes.addressof(anchor)), ctypes.c_size_t(size), vec)
            del anchor
            if rc != 0:
                return None
        finally:
            mm.close()
        cached += sum(b & 1 for b in bytes(vec))
        total += pages
    return cached / total if total else None


def warm_up(paths: Iterable[str]) -> None:
    """Read the files once so that their pages are in the page cache."""
    buf = read_buffer()
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


def fsync_path(path: str) -> None:
    """fsync a file (or directory) by path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def copy_limit(sources: dict[str, torch.Tensor], targets: dict[str, torch.Tensor], passes: int = 3) -> float:
    """Seconds to ``copy_`` every source into its (resident) target: the memory-copy limit.

    The fastest of ``passes`` passes: on a shared machine torch's OpenMP threads can
    stall at a barrier for a whole pass (one pass of 1 GB measured 0.08 s and the
    next 1.0 s), and a limit is the best the machine does, not its bad moments.
    """
    best = float("inf")
    for _ in range(passes):
        t0 = time.perf_counter()
        for k, v in sources.items():
            targets[k].copy_(v)
        best = min(best, time.perf_counter() - t0)
    return best


def _random_buffer(n: int) -> mmap.mmap:
    buf = mmap.mmap(-1, n)  # anonymous maps are page-aligned, as O_DIRECT requires
    buf.write(os.urandom(n))
    return buf


def write_limit(path: str, nbytes: int, *, direct: bool, buf: mmap.mmap | None = None) -> float | None:
    """Seconds to write ``nbytes`` sequentially in CHUNK-sized writes and fsync.

    ``direct`` opens with O_DIRECT (the tail padded to the block size); returns
    None where the filesystem refuses O_DIRECT.
    """
    buf = buf if buf is not None else _random_buffer(CHUNK)
    view = memoryview(buf)
    if os.path.exists(path):
        os.unlink(path)
        os.sync()  # the freed blocks' journal commit (and discards, on a discard mount) is not this write's
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (getattr(os, "O_DIRECT", 0) if direct else 0)
    t0 = time.perf_counter()
    try:
        fd = os.open(path, flags, 0o644)
    except OSError:
        return None
    try:
        off = 0
        while off < nbytes:
            n = min(len(view), nbytes - off)
            if direct:
                n = (n + _BLOCK - 1) // _BLOCK * _BLOCK
            try:
                written = os.pwrite(fd, view[:n], off)
            except OSError:
                if direct and off == 0:
                    return None
                raise
            off += written
        if direct and off != nbytes:
            os.ftruncate(fd, nbytes)
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - t0


_READ_BUF: list[bytearray] = []


def read_buffer() -> bytearray:
    """The single-stream limit's CHUNK-sized buffer: made and faulted in once, reused by every call.

    A fresh 64 MiB buffer a call put its page faults (about 60 ms a GB read here) inside
    the timed read, so the limit looked about 10% slower than the disk.
    """
    if not _READ_BUF:
        buf = bytearray(CHUNK)
        buf[::mmap.PAGESIZE] = b"\1" * len(range(0, CHUNK, mmap.PAGESIZE))  # fault every page in now
        _READ_BUF.append(buf)
    return _READ_BUF[0]


def cold_read_limit(path: str) -> float:
    """Seconds to read ``path`` from a cold page cache with CHUNK-sized reads into one reused buffer."""
    evict([path])
    buf = read_buffer()
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass
    return time.perf_counter() - t0


def _meminfo_total() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _fs_type(path: str) -> str | None:
    """The filesystem type of the mount holding ``path`` (longest matching mount point)."""
    real, best = os.path.realpath(path), ("", None)
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 3 and os.path.commonpath([real, parts[1]]) == parts[1] and len(parts[1]) >= len(best[0]):
                    best = (parts[1], parts[2])
    except OSError:
        pass
    return best[1]


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_info(bench_dir: str) -> dict[str, object]:
    """What the run's figures depend on: CPU, memory, kernel, filesystem, versions."""
    import safetensors

    return {
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "memory_bytes": _meminfo_total(),
        "kernel": platform.release(),
        "filesystem": _fs_type(bench_dir),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "safetensors": safetensors.__version__,
    }
