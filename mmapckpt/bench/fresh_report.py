"""The results of ``mmapckpt bench --fresh``: the JSON document and the text table.

A row's ``of limit`` is the limit's median seconds over the row's (a throughput ratio), first
load against the limit's first (cold) read, second against its second (warm) one. Beside each
phase's wall seconds stand the child's CPU seconds over the same span (``time.process_time``, every
thread): a load whose CPU is far below its wall time waited (on the disk, on its threads), one whose
CPU is near or above it computed.
"""

from __future__ import annotations

import statistics
from typing import Any

__all__ = ["document", "render_table"]

_RETURNS_NOTE = ("returns: fill = copied into targets allocated and zeroed before the clock; views = tensors over "
                 "the files' mappings or the loader's buffer, new = new tensors (both touched, one byte a page, "
                 "inside the timed call); the limit reads into memory allocated but never touched (its page "
                 "faults are timed)")


def _stats(xs: list[float]) -> dict[str, Any]:
    return {"median_s": statistics.median(xs), "min_s": min(xs), "max_s": max(xs), "n": len(xs)}


def _ratio(limit: dict[str, Any] | None, row: dict[str, Any] | None) -> float | None:
    return limit["median_s"] / row["median_s"] if limit and row and row["median_s"] > 0 else None


def _phases(times: dict[str, list[float]], cpu: dict[str, list[float]]) -> dict[str, Any]:
    """Wall and CPU seconds of each phase (``first``, ``second``, ``first_cpu``, ``second_cpu``); None where none ran."""
    return {**{p: _stats(times[p]) if times.get(p) else None for p in ("first", "second")},
            **{f"{p}_cpu": _stats(cpu[p]) if cpu.get(p) else None for p in ("first", "second")}}


def _row(m: Any, times: dict[str, list[float]], cpu: dict[str, list[float]], cached: list[float] | None,
         ok: bool) -> dict[str, Any]:
    reads = None if m.peer is None else ("O_DIRECT" if m.peer.direct else "buffered")
    return {"method": m.key, "label": m.label, "returns": m.returns, "reads": reads, "file": m.reads,
            "peer": m.peer is not None, **_phases(times, cpu),
            "cached_after_first": statistics.median(cached) if cached else None, "bitwise": ok}


def document(*, info: dict[str, Any], times: dict[str, dict[str, list[float]]], cpu: dict[str, dict[str, list[float]]],
             system: dict[str, dict[str, list[float]]], cached: dict[str, list[float]], ok: dict[str, bool],
             skipped: dict[str, str], failed: dict[str, str],
             methods: list[Any], many: dict[str, tuple[str, str, bool]]) -> dict[str, Any]:
    """The JSON-ready result: the limit, a row per method that ran, the many-entry rows, what was skipped;
    ``raw_times``, ``raw_cpu_times`` and ``raw_sys_times`` hold every repetition's wall, CPU and system CPU
    seconds, in the same order (a slow repetition whose extra time is system time was slowed in the kernel)."""
    limit_key = methods[0].key
    rows = [_row(m, times[m.key], cpu.get(m.key, {}), cached.get(m.key), ok.get(m.key, False))
            for m in methods if m.key in times]
    limit = next((r for r in rows if r["method"] == limit_key), None)
    for r in rows:
        r["first_of_limit"] = _ratio(limit and limit["first"], r["first"])
        r["second_of_limit"] = _ratio(limit and limit["second"], r["second"])
    many_rows = []
    for key, (label, reads, whole) in many.items():
        if key in times:
            many_rows.append({"method": key, "label": label, "file": reads, "whole_process": whole,
                              **_phases(times[key], cpu.get(key, {})), "bitwise": ok.get(key, False)})
    by = {r["method"]: r for r in many_rows}
    for mine, theirs in (("open_keys", "safetensors_keys"), ("inspect", "safetensors_keys_process")):
        if mine in by and theirs in by:
            for phase in ("first", "second"):
                by[mine][f"{phase}_vs_safetensors"] = _ratio(by[theirs][phase], by[mine][phase])
    all_ok = not failed and all(r["bitwise"] for r in rows + many_rows)
    return {"run": info, "rows": rows, "many": many_rows, "skipped": skipped, "failed": failed,
            "ok": all_ok, "raw_times": times, "raw_cpu_times": cpu, "raw_sys_times": system}


def _cell(s: dict[str, Any] | None) -> str:
    return "-" if s is None else f"{s['median_s']:.3f} ({s['min_s']:.3f}-{s['max_s']:.3f})"


def _cpu(s: dict[str, Any] | None) -> str:
    return "-" if s is None else f"{s['median_s']:.3f}"


def _frac(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def render_table(doc: dict[str, Any]) -> str:
    """The run as a plain-text table, with the many-entry rows, the skipped peers and the notes below it."""
    run, mach = doc["run"], doc["run"]["machine"]
    before = ", ".join(f"{x:.2f}" for x in run["load_average_before"])
    after = ", ".join(f"{x:.2f}" for x in run["load_average_after"])
    lines = [f"fresh processes: {run['tensors']} tensors, {run['bytes'] / 1e9:.3f} GB {run['dtype']}, median of "
             f"{run['repeats']} (min-max), seconds from torch imported and targets allocated to every byte in "
             f"place, the library's import included; machine: {mach['cpu_count']} CPUs, "
             f"{(mach['memory_bytes'] or 0) / 2**30:.0f} GiB, {mach['filesystem']}; load average "
             f"{before} before, {after} after", ""]
    head = (f"{'method':<52}{'returns':<8}{'first (cold) s':>22}{'cpu s':>7}{'of limit':>9}{'second s':>22}"
            f"{'cpu s':>7}{'of limit':>9}{'cached':>8}  {'bitwise'}")
    lines += [head, "-" * len(head)]
    for r in doc["rows"]:
        label = r["label"] + (f" [{r['reads']}]" if r["reads"] else "")
        cached = "-" if r["cached_after_first"] is None else f"{r['cached_after_first']:.0%}"
        lines.append(f"{label[:51]:<52}{r['returns']:<8}{_cell(r['first']):>22}{_cpu(r.get('first_cpu')):>7}"
                     f"{_frac(r['first_of_limit']):>9}{_cell(r['second']):>22}{_cpu(r.get('second_cpu')):>7}"
                     f"{_frac(r['second_of_limit']):>9}{cached:>8}  {'ok' if r['bitwise'] else 'FAILED'}")
    lines += [_RETURNS_NOTE, "cached: the fraction of the file's pages in the page cache after the first load "
              "(what the second finds)", "cpu s: the median of the child's CPU seconds over the same span "
              "(every thread; far below the wall seconds: the load waited)"]
    if doc["many"]:
        lines += ["", f"{run['open_entries']} tensors (16 MB): seconds, first (cold) and second, each with its CPU "
                  "seconds; 'vs safetensors': its time over ours (above 1: we are faster)"]
        for r in doc["many"]:
            vs = "".join(f"  {p} vs safetensors {_frac(r[f'{p}_vs_safetensors'])}" for p in ("first", "second")
                         if f"{p}_vs_safetensors" in r)
            lines.append(f"  {r['label']:<50}{_cell(r['first']):>22} cpu {_cpu(r.get('first_cpu'))}"
                         f"{_cell(r['second']):>22} cpu {_cpu(r.get('second_cpu'))}"
                         f"  {'ok' if r['bitwise'] else 'FAILED'}{vs}")
    for key, why in doc["skipped"].items():
        lines.append(f"skipped {key}: {why}")
    for key, why in doc["failed"].items():
        lines.append(f"FAILED {key}: {why}")
    lines.append(f"order of the first repetition: {', '.join(run['orders'][0])}" if run["orders"] else "")
    return "\n".join(lines).rstrip()
