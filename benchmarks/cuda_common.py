"""What the accelerator benchmarks share (cuda_bench.py, cuda_save_bench.py, cuda_register_bench.py).

Imported by them as a sibling module: each runs as ``python benchmarks/NAME.py``, whose own
folder is then first on ``sys.path``.
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any, Callable

import torch

__all__ = ["device_or_exit", "sync", "timed", "stats"]


def device_or_exit(name: str, script: str) -> torch.device:
    """``torch.device("cpu")`` for the smoke mode, else the current CUDA device; without one, say so on stderr
    and exit with status 2, having measured nothing."""
    if name == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        print(f"{script}: no CUDA device is available (torch.cuda.is_available() is False; "
              f"torch {torch.__version__}, built with CUDA {torch.version.cuda}). "
              "This benchmark needs an NVIDIA GPU; nothing was measured. "
              "(--device cpu runs a smoke version on the CPU.)", file=sys.stderr)
        sys.exit(2)
    return torch.device("cuda", torch.cuda.current_device())


def sync(dev: torch.device) -> None:
    """Wait for the device's queued work (nothing to wait for on the CPU)."""
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed(fn: Callable[[], Any], dev: torch.device) -> tuple[float, Any]:
    """Seconds ``fn`` took, its queued device work included, and what it returned."""
    sync(dev)
    t0 = time.perf_counter()
    out = fn()
    sync(dev)
    return time.perf_counter() - t0, out


def stats(xs: list[float], nbytes: int) -> dict[str, float]:
    """The median, min and max of ``xs`` seconds, the median's GB/s for ``nbytes``, and the count."""
    med = statistics.median(xs)
    return {"median_s": med, "min_s": min(xs), "max_s": max(xs), "gbps": nbytes / med / 1e9, "n": len(xs)}
