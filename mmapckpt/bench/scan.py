"""Scaling scans: time against size, and against entry count (the many-entry targets of ``mmapckpt bench``;
the whole sweep, its table and chart: ``python benchmarks/scan_bench.py``).

- ``sizes``: the same tensor count at several total sizes; time should grow linearly,
  so seconds per GB should stay level.
- ``tensors``: the same total bytes split into more and more tensors, and an Adam
  optimizer state dict (entries.py): every method's operations (methods.py ``scan_ops``)
  in microseconds per entry at each point, with their ratios to safetensors' counterparts
  and the issue's targets; also the slope of a least-squares line through (count, seconds).

Each point is the median of ``repeats`` runs; saves fsync, loads are warm. Every warm
load into targets is checked bitwise once, after its timings.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from typing import Any, Callable

import torch

from . import entries
from .methods import method_by_key, scan_ops
from .synthetic import transformer_state_dict
from .system import files_under, warm_up

__all__ = ["scan", "DCP_MAX_ENTRIES", "PHASES"]

PHASES = ("save", "plan_save", "warm", "plan", "lazy", "open")
#: Above this many entries the stock DCP is skipped in the tensor scan by default (about 0.5 ms an entry).
DCP_MAX_ENTRIES = 20_000
Ops = dict[str, tuple[str, Callable]]


def _median_time(fn: Callable[[], object], repeats: int, before: Callable[[], None] = lambda: None) -> float:
    xs = []
    for _ in range(repeats):
        before()
        t0 = time.perf_counter()
        fn()
        xs.append(time.perf_counter() - t0)
    return statistics.median(xs)


def _clear(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)
    os.sync()  # the removed checkpoint's journal commit (and discards) is not the next save's


def _point(ops: Ops, sd: Any, path: str, repeats: int) -> tuple[dict[str, float], bool]:
    """Median seconds of each operation in ``ops`` on ``sd``; and whether the warm load was bitwise right."""
    targets = entries.targets_like(sd)
    out = {"save": _median_time(lambda: ops["save"][1](sd, path), repeats, lambda: _clear(path))}
    if ops.get("plan_save") is not None:  # as the save, writing nothing
        out["plan_save"] = _median_time(lambda: ops["plan_save"][1](sd, path), repeats)
    out["warm"] = _median_time(lambda: ops["warm"][1](targets, path), repeats, lambda: warm_up(files_under(path)))
    correct = entries.same_values(sd, targets)
    if ops.get("plan") is not None:  # as the warm load, without the reader's copies
        out["plan"] = _median_time(lambda: ops["plan"][1](targets, path), repeats, lambda: warm_up(files_under(path)))
    for ph in ("lazy", "open"):
        if ops.get(ph) is not None:
            out[ph] = _median_time(lambda: ops[ph][1](path), repeats)  # noqa: B023 - called at once
    _clear(path)
    return out, correct


def _method_ops(kind: str, key: str) -> tuple[Ops, bool]:
    if kind == "tensors":
        so = scan_ops(key)
        return so.ops, so.nested
    m = method_by_key(key)
    ops: Ops = {"save": ("save", m.save), "warm": ("load into targets", m.load_into)}
    if m.lazy is not None:
        ops["lazy"] = (m.lazy_label or "lazy", m.lazy)
    return ops, True


def _cases(kind: str, points: list[int], fixed: int, dtype: torch.dtype, adam_layers: int):  # type: ignore[no-untyped-def]
    for p in points:
        size, layers = (p, max(1, round((fixed - 3) / 10))) if kind == "sizes" else (fixed, max(1, round((p - 3) / 10)))
        yield "transformer", transformer_state_dict(size, dtype=dtype, layers=layers)
    if kind == "tensors" and adam_layers > 0:
        yield "adam", entries.adam_state_dict(adam_layers)

def _slope(xs: list[float], ys: list[float]) -> float:
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den if den else 0.0


def scan(kind: str, points: list[int], *, fixed: int, dtype: torch.dtype, repeats: int, methods: list[str],
         bench_dir: str, log: Callable[[str], None] = print, adam_layers: int = 0,
         dcp_max_entries: int | None = DCP_MAX_ENTRIES) -> dict[str, Any]:
    """Run a scan; ``points`` are sizes in bytes (kind "sizes") or tensor counts ("tensors").

    For "tensors", ``adam_layers`` > 0 adds the Adam state dict of a model of that many layers,
    and the stock DCP ("dcp") is skipped where a state dict has more than ``dcp_max_entries``
    entries (None: never).
    """
    if kind not in ("sizes", "tensors"):
        raise ValueError(f"unknown scan {kind!r}: use sizes or tensors")
    root = tempfile.mkdtemp(prefix=".mmapckpt-scan-", dir=bench_dir)
    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    try:
        for case, sd in _cases(kind, points, fixed, dtype, adam_layers):
            flat, leaves, dropped = entries.flatten_tensors(sd)
            nbytes = sum(t.nbytes for t in flat.values())
            log(f"scan {kind}: {case}, {len(flat)} tensors ({leaves} entries), {nbytes / 1e9:.3f} GB")
            if dropped:
                notes.append(f"{case}: {len(flat)} tensors and {dropped} non-tensor entries; safetensors and "
                             "mmapckpt-api (save_file, mmapckpt.save) get the flattened tensors only, the DCP "
                             "methods the nested state dict")
            for key in methods:
                if key == "dcp" and kind == "tensors" and dcp_max_entries is not None and leaves > dcp_max_entries:
                    notes.append(f"{case}: dcp (stock DCP) skipped at {leaves} entries: over the cap of "
                                 f"{dcp_max_entries} (--dcp-max-entries)")
                    continue
                ops, nested = _method_ops(kind, key)
                times, correct = _point(ops, sd if nested else flat, os.path.join(root, key), repeats)
                row = {"case": case, "method": key, "tensors": len(flat), "entries": leaves if nested else len(flat),
                       "bytes": nbytes, "correct": correct, "ops": {ph: ops[ph][0] for ph in times},
                       **{f"{k}_s": v for k, v in times.items()}}
                if kind == "tensors":
                    row.update({f"{k}_us_per_entry": 1e6 * v / len(flat) for k, v in times.items()})
                rows.append(row)
            del sd, flat
    finally:
        shutil.rmtree(root, ignore_errors=True)
    summary = _summary(kind, [r for r in rows if r["case"] == "transformer"], methods)
    if kind == "tensors":
        summary.update(entries.summarize(rows))
    return {"kind": kind, "rows": rows, "summary": summary, "notes": notes}


def _summary(kind: str, rows: list[dict[str, Any]], methods: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for m in methods:
        mine = [r for r in rows if r["method"] == m]
        for ph in PHASES:
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
            for ph in PHASES:
                a, b = out.get(f"{m}.{ph}.per_tensor_us"), out.get(f"safetensors.{ph}.per_tensor_us")
                if a is not None and b:
                    out[f"{m}.{ph}.overhead_vs_safetensors"] = a / b
    return out
