"""Scaling scans for ``mmapckpt bench --scan``: time against size, and against tensor count.

- ``sizes``: the same tensor count at several total sizes; time should grow linearly,
  so seconds per GB should stay level.
- ``tensors``: the same total bytes split into more and more tensors; the slope of
  a least-squares line through (count, seconds) is the per-tensor overhead, which is
  compared with safetensors' (the target: within 2x).

Each point is the median of ``repeats`` runs; saves fsync, loads are warm.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from typing import Any, Callable

import torch

from .methods import Method, method_by_key
from .synthetic import transformer_state_dict
from .system import files_under, warm_up

__all__ = ["scan"]

_PHASES = ("save", "warm", "lazy")


def _median_time(fn: Callable[[], object], repeats: int, before: Callable[[], None] = lambda: None) -> float:
    xs = []
    for _ in range(repeats):
        before()
        t0 = time.perf_counter()
        fn()
        xs.append(time.perf_counter() - t0)
    return statistics.median(xs)


def _point(m: Method, sd: dict[str, torch.Tensor], path: str, repeats: int) -> dict[str, float]:
    targets = {k: torch.empty_like(v).zero_() for k, v in sd.items()}
    out = {"save": _median_time(lambda: m.save(sd, path), repeats,
                                lambda: shutil.rmtree(path, ignore_errors=True))}
    out["warm"] = _median_time(lambda: m.load_into(targets, path), repeats, lambda: warm_up(files_under(path)))
    if m.lazy is not None:
        out["lazy"] = _median_time(lambda: m.lazy(path), repeats)  # type: ignore[misc]
    shutil.rmtree(path, ignore_errors=True)
    return out


def _slope(xs: list[float], ys: list[float]) -> float:
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den if den else 0.0


def scan(kind: str, points: list[int], *, fixed: int, dtype: torch.dtype, repeats: int, methods: list[str],
         bench_dir: str, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run a scan; ``points`` are sizes in bytes (kind "sizes") or tensor counts ("tensors")."""
    if kind not in ("sizes", "tensors"):
        raise ValueError(f"unknown scan {kind!r}: use sizes or tensors")
    root = tempfile.mkdtemp(prefix=".mmapckpt-scan-", dir=bench_dir)
    rows: list[dict[str, Any]] = []
    try:
        for p in points:
            size, layers = (p, max(1, round((fixed - 3) / 10))) if kind == "sizes" else (fixed, max(1, round((p - 3) / 10)))
            sd = transformer_state_dict(size, dtype=dtype, layers=layers)
            nbytes = sum(t.nbytes for t in sd.values())
            log(f"scan {kind}: {len(sd)} tensors, {nbytes / 1e9:.3f} GB")
            for key in methods:
                times = _point(method_by_key(key), sd, os.path.join(root, key), repeats)
                rows.append({"method": key, "tensors": len(sd), "bytes": nbytes, **{f"{k}_s": v for k, v in times.items()}})
            del sd
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {"kind": kind, "rows": rows, "summary": _summary(kind, rows, methods)}


def _summary(kind: str, rows: list[dict[str, Any]], methods: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for m in methods:
        mine = [r for r in rows if r["method"] == m]
        for ph in _PHASES:
            pts = [r for r in mine if f"{ph}_s" in r]
            if len(pts) < 2:
                continue
            if kind == "tensors":
                out[f"{m}.{ph}.per_tensor_us"] = 1e6 * _slope([r["tensors"] for r in pts], [r[f"{ph}_s"] for r in pts])
            else:
                per_gb = [r[f"{ph}_s"] / (r["bytes"] / 1e9) for r in pts]
                out[f"{m}.{ph}.s_per_gb"] = per_gb
    if kind == "tensors" and "safetensors" in methods:
        for m in methods:
            for ph in _PHASES:
                a, b = out.get(f"{m}.{ph}.per_tensor_us"), out.get(f"safetensors.{ph}.per_tensor_us")
                if a is not None and b:
                    out[f"{m}.{ph}.overhead_vs_safetensors"] = a / b
    return out


def render(doc: dict[str, Any]) -> str:
    """The scan as a text table, with its summary."""
    phases = [p for p in _PHASES if any(f"{p}_s" in r for r in doc["rows"])]
    head = f"{'method':<13}{'tensors':>9}{'GB':>8}" + "".join(f"{p + ' s':>10}" for p in phases)
    lines = [f"scan: {doc['kind']}", head, "-" * len(head)]
    for r in doc["rows"]:
        lines.append(f"{r['method']:<13}{r['tensors']:>9}{r['bytes'] / 1e9:>8.3f}"
                     + "".join(f"{r[p + '_s']:>10.4f}" if p + "_s" in r else f"{'-':>10}" for p in phases))
    for k, v in doc["summary"].items():
        val = ", ".join(f"{x:.3f}" for x in v) if isinstance(v, list) else f"{v:.2f}"
        lines.append(f"  {k}: {val}")
    return "\n".join(lines)
