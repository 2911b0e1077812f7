"""The benchmark's results: the JSON document, the text table, the targets and the chart.

Fractions are throughput ratios measured in the same run: a method's GB/s divided
by the limit's GB/s (that is, the limit's median seconds over the method's).
"""

from __future__ import annotations

import statistics
from typing import Any

__all__ = ["document", "render_table", "plot", "PHASES", "TARGETS", "TARGET_METHODS", "SAVE_NOTE", "TARGETS_NOTE"]

#: phase -> (label, the limit it is measured against)
PHASES: dict[str, tuple[str, str]] = {
    "save": ("save (fsync)", "write_buffered"),
    "warm": ("warm load into targets", "copy"),
    "cold": ("cold load into targets", "cold_read"),
    "lazy": ("lazy open", "safetensors_lazy"),
}
LIMIT_LABELS = {
    "copy": "copy_ into targets",
    "write_buffered": "write+fsync, buffered",
    "write_direct": "write+fsync, O_DIRECT",
    "cold_read": "sequential cold read",
    "safetensors_lazy": "safetensors load_file",
}
#: phase -> the least fraction of its limit mmapckpt must reach (issue 6, section 2)
TARGETS = {"warm": 0.85, "cold": 0.9, "save": 1.5, "lazy": 1.0}
MEMORY_TARGET_BYTES = 64 << 20


def _stats(xs: list[float]) -> dict[str, float]:
    return {"median_s": statistics.median(xs), "min_s": min(xs), "max_s": max(xs), "n": len(xs)}


def _limits(limits: dict[str, list[float]], nbytes: int) -> dict[str, dict[str, float]]:
    out = {}
    for name, xs in limits.items():
        s = _stats(xs)
        out[name] = {**s, "gbps": nbytes / s["median_s"] / 1e9, "label": LIMIT_LABELS[name]}
    return out


def _rows(times: dict[str, dict[str, list[float]]], lim: dict[str, Any], nbytes: int,
          methods: list[str]) -> list[dict[str, Any]]:
    rows = []
    for phase, (_label, limit_name) in PHASES.items():
        dcp = times.get("dcp", {}).get(phase)
        for m in methods:
            xs = times.get(m, {}).get(phase)
            if not xs:
                continue
            s = _stats(xs)
            limit_s = lim.get(limit_name, {}).get("median_s")
            row = {"method": m, "phase": phase, **s, "gbps": nbytes / s["median_s"] / 1e9,
                   "limit": limit_name, "fraction_of_limit": (limit_s / s["median_s"]) if limit_s else None,
                   "ratio_to_dcp": (statistics.median(dcp) / s["median_s"]) if dcp else None}
            if phase == "save" and "write_direct" in lim:
                row["fraction_of_direct"] = lim["write_direct"]["median_s"] / s["median_s"]
            rows.append(row)
    return rows


#: The methods held to the targets: through dcp.save/dcp.load, and through mmapckpt's own functions.
TARGET_METHODS = ("mmapckpt", "mmapckpt-api")


def _targets(rows: list[dict[str, Any]], memory: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for r in rows:
        if r["method"] in TARGET_METHODS and r["phase"] in TARGETS and r["fraction_of_limit"] is not None:
            out.append({"method": r["method"], "phase": r["phase"], "target": TARGETS[r["phase"]],
                        "measured": r["fraction_of_limit"], "met": r["fraction_of_limit"] >= TARGETS[r["phase"]]})
    for key in TARGET_METHODS:
        m = memory.get(key)
        if m:
            out.append({"method": key, "phase": "memory", "target": MEMORY_TARGET_BYTES,
                        "measured": m["peak_anon_added"], "met": m["peak_anon_added"] < MEMORY_TARGET_BYTES})
    return out


def document(*, run_info: dict[str, Any], times: dict[str, dict[str, list[float]]], limits: dict[str, list[float]],
             memory: dict[str, Any], methods: list[str]) -> dict[str, Any]:
    """The JSON-ready result of a run."""
    nbytes = run_info["bytes"]
    lim = _limits(limits, nbytes)
    if times.get("safetensors", {}).get("lazy"):
        s = _stats(times["safetensors"]["lazy"])
        lim["safetensors_lazy"] = {**s, "gbps": nbytes / s["median_s"] / 1e9, "label": LIMIT_LABELS["safetensors_lazy"]}
    rows = _rows(times, lim, nbytes, methods)
    return {"run": run_info, "limits": lim, "rows": rows, "memory": memory, "targets": _targets(rows, memory),
            "raw_times": times}


def _fmt(x: float | None, spec: str, suffix: str = "") -> str:
    return "-" if x is None else f"{x:{spec}}{suffix}"


def _table_rows(doc: dict[str, Any]) -> list[str]:
    head = (f"{'phase':<24}{'method':<15}{'median s':>9}{'min':>8}{'max':>8}{'GB/s':>7}  {'of limit':>8} "
            f"{'limit':<24}{'O_DIRECT':>8}{'vs DCP':>8}")
    lines = [head, "-" * len(head)]
    for name, s in doc["limits"].items():
        if name != "safetensors_lazy":
            lines.append(f"{'limit: ' + s['label']:<39}{s['median_s']:>9.3f}{s['min_s']:>8.3f}{s['max_s']:>8.3f}"
                         f"{s['gbps']:>7.2f}")
    for r in doc["rows"]:
        lim = LIMIT_LABELS.get(r["limit"], r["limit"])
        direct = _fmt(r.get("fraction_of_direct"), ".2f") if r["phase"] == "save" else ""
        lines.append(f"{PHASES[r['phase']][0]:<24}{r['method']:<15}{r['median_s']:>9.3f}{r['min_s']:>8.3f}"
                     f"{r['max_s']:>8.3f}{r['gbps']:>7.2f}  {_fmt(r['fraction_of_limit'], '8.2f'):>8} {lim:<24}"
                     f"{direct:>8}{_fmt(r['ratio_to_dcp'], '7.2f', 'x'):>8}")
    return lines


#: Why a save can reach several times its limit, printed under the table.
SAVE_NOTE = ("save rows: 'of limit' is against a buffered write+fsync of as many bytes (the page cache's write "
             "path), 'O_DIRECT' against an O_DIRECT write+fsync, the path mmapckpt's shards take; above 1 of the "
             "buffered limit is that difference, not a measurement error")
#: What the targets are, in one line, when --targets does not list them.
TARGETS_NOTE = ("the project's goals for mmapckpt, as fractions of this run's limits: "
                + "; ".join(f"{p} >= {v} of {LIMIT_LABELS[PHASES[p][1]]}" for p, v in TARGETS.items())
                + f"; memory added by a load < {MEMORY_TARGET_BYTES >> 20} MB")


def _target_lines(doc: dict[str, Any], listed: bool) -> list[str]:
    met = sum(t["met"] for t in doc["targets"])
    missed = [t for t in doc["targets"] if not t["met"]]
    if not listed:
        short = ", ".join(f"{t['method']} {t['phase']}" for t in missed)
        return ["", (f"targets: {met} of {len(doc['targets'])} met{' (missed: ' + short + ')' if short else ''}, "
                     f"--targets lists them; they are {TARGETS_NOTE}")]
    lines = ["", "mmapckpt against the targets:"]
    for t in doc["targets"]:
        who = f"  {t['method']:<13}"
        if t["phase"] == "memory":
            lines.append(f"{who}memory: peak anon {t['measured'] / 2**20:.1f} MB, target < 64 MB: "
                         f"{'met' if t['met'] else 'MISSED'}")
        else:
            lines.append(f"{who}{PHASES[t['phase']][0]}: {t['measured']:.2f} of "
                         f"{LIMIT_LABELS[PHASES[t['phase']][1]]}, target >= {t['target']}: "
                         f"{'met' if t['met'] else 'MISSED'}")
    return lines


def render_table(doc: dict[str, Any], *, targets: bool = False) -> str:
    """The run as a plain-text table, with memory, targets and notes below it.

    ``targets`` lists every target with its measured fraction; otherwise one line counts
    them and says what they are.
    """
    run = doc["run"]
    lines = [f"{run['tensors']} tensors, {run['bytes'] / 1e9:.3f} GB {run['dtype']}, median of {run['repeats']} "
             f"(min, max); machine: {run['machine']['cpu_count']} CPUs, {run['machine']['cpu']}, "
             f"{(run['machine']['memory_bytes'] or 0) / 2**30:.0f} GiB, {run['machine']['filesystem']}", ""]
    lines += _table_rows(doc)
    if any(r["phase"] == "save" for r in doc["rows"]):
        lines.append(SAVE_NOTE)
    if doc["memory"]:
        lines += ["", f"{'memory added by a warm load into targets':<44}{'peak RSS':>10}{'peak anon':>11}{'anon after':>11}"]
        for m, v in doc["memory"].items():
            lines.append(f"{m:<44}{_fmt(v['peak_rss_added'] and v['peak_rss_added'] / 2**20, '8.1f', 'MB'):>10}"
                         f"{v['peak_anon_added'] / 2**20:>9.1f}MB{v['anon_added_after'] / 2**20:>9.1f}MB")
    if doc["targets"]:
        lines += _target_lines(doc, targets)
    lines.append("")
    paths = "; ".join(f"{k}: {', '.join(v)}" for k, v in run["write_paths"].items())
    lines.append(f"shard write path (MmapWriter.write_path): {paths or 'not reported'}")
    lines.append("bitwise check of every method: " + ", ".join(f"{k} {'ok' if v else 'FAILED'}"
                                                              for k, v in run["correct"].items()))
    lines += [f"note: {n}" for n in run["notes"]]
    return "\n".join(lines)


def plot(doc: dict[str, Any], path: str) -> str | None:
    """Draw GB/s per phase and method, with each phase's limit as a line; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    phases = [p for p in PHASES if p != "lazy" and any(r["phase"] == p for r in doc["rows"])]
    methods = list(dict.fromkeys(r["method"] for r in doc["rows"]))
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / max(1, len(methods))
    for j, m in enumerate(methods):
        vals = [next((r["gbps"] for r in doc["rows"] if r["method"] == m and r["phase"] == p), 0) for p in phases]
        ax.bar([i + j * width for i in range(len(phases))], vals, width, label=m)
    for i, p in enumerate(phases):
        lim = doc["limits"].get(PHASES[p][1])
        if lim:
            ax.hlines(lim["gbps"], i - width / 2, i + 0.8 - width / 2, colors="k", linestyles="dashed")
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(phases))], [PHASES[p][0] for p in phases])
    ax.set_ylabel("GB/s (median); dashed: the phase's limit")
    ax.set_title(f"{doc['run']['bytes'] / 1e9:.2f} GB, {doc['run']['tensors']} tensors")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
