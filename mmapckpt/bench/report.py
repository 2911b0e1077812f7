"""The benchmark's results: the JSON document, the text table, the targets and the chart.

Fractions are throughput ratios measured in the same run: a method's GB/s divided
by the limit's GB/s (that is, the limit's median seconds over the method's).
"""

from __future__ import annotations

import json
import os
import statistics
from typing import Any

from .disk import SWEEP
from .disk import limit_label as disk_limit_label
from .targets import evaluate
from .targets import render as render_targets

__all__ = ["document", "render_table", "plot", "row_prefix", "PHASES", "SAVE_NOTE", "RETURNS_NOTE", "LIMIT_LABELS",
           "limit_label", "READ_LIMITS", "write_json"]

#: phase -> (label, the limit it is measured against)
PHASES: dict[str, tuple[str, str]] = {
    "save": ("save (fsync)", "write_buffered"),
    "warm": ("warm load", "copy"),
    "cold": ("cold load", "disk_best"),
    "lazy": ("lazy open", "safetensors_lazy"),
}
LIMIT_LABELS = {
    "copy": "copy_ into targets",
    "write_buffered": "write+fsync, buffered",
    "write_direct": "write+fsync, O_DIRECT",
    "cold_read": "cold read, 1 buffered stream",
    "disk_best": "best disk read",
    "safetensors_lazy": "safetensors load_file",
}
#: the limits a cold load is held to the best of
READ_LIMITS = ("cold_read",) + tuple(name for name, *_ in SWEEP)


def limit_label(name: str) -> str:
    return LIMIT_LABELS.get(name) or ("cold read, " + disk_limit_label(name))


def _stats(xs: list[float]) -> dict[str, float]:
    return {"median_s": statistics.median(xs), "min_s": min(xs), "max_s": max(xs), "n": len(xs)}


def _limits(limits: dict[str, list[float]], nbytes: int) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for name, xs in limits.items():
        s = _stats(xs)
        out[name] = {**s, "gbps": nbytes / s["median_s"] / 1e9, "label": limit_label(name)}
    reads = [n for n in READ_LIMITS if n in out]
    if reads:
        best = min(reads, key=lambda n: out[n]["median_s"])
        out["disk_best"] = {**out[best], "of": best, "label": f"best disk read ({out[best]['label']})"}
    return out


def _row(m: str, phase: str, xs: list[float], lim: dict[str, Any], nbytes: int, dcp: list[float] | None,
         limit_name: str) -> dict[str, Any]:
    s = _stats(xs)
    limit_s = lim.get(limit_name, {}).get("median_s")
    row = {"method": m, "phase": phase, **s, "gbps": nbytes / s["median_s"] / 1e9,
           "limit": limit_name, "fraction_of_limit": (limit_s / s["median_s"]) if limit_s else None,
           "ratio_to_dcp": (statistics.median(dcp) / s["median_s"]) if dcp else None}
    if phase == "save" and "write_direct" in lim:
        row["fraction_of_direct"] = lim["write_direct"]["median_s"] / s["median_s"]
    if phase == "cold" and "cold_read" in lim:
        row["fraction_of_single_stream"] = lim["cold_read"]["median_s"] / s["median_s"]
    return row


def _rows(times: dict[str, dict[str, list[float]]], lim: dict[str, Any], nbytes: int, methods: list[str],
          peers: dict[str, Any] | None, direct: dict[str, bool]) -> list[dict[str, Any]]:
    peer_info = (peers or {}).get("run", {})
    rows = []
    for phase, (_label, limit_name) in PHASES.items():
        dcp = times.get("dcp", {}).get(phase)
        for m in methods + list((peers or {}).get("order", [])):
            xs = times.get(m, {}).get(phase)
            if not xs:
                continue
            row = _row(m, phase, xs, lim, nbytes, dcp, limit_name)
            if m in peer_info:
                row.update(peer=True, returns=peer_info[m]["kind"], direct=peer_info[m]["direct"])
            elif phase in ("warm", "cold"):
                row.update(peer=False, returns="fill", direct=direct.get(m, False))
            else:  # a save, or a lazy open (its tensors untouched: no claim on what they hold yet)
                row.update(peer=False, returns=None, direct=None)
            rows.append(row)
    return rows


def document(*, run_info: dict[str, Any], times: dict[str, dict[str, list[float]]], limits: dict[str, list[float]],
             memory: dict[str, Any], methods: list[str], peers: dict[str, Any] | None = None,
             direct: dict[str, bool] | None = None, scan: dict[str, Any] | None = None) -> dict[str, Any]:
    """The JSON-ready result of a run.

    ``peers``: the peer loaders' ``run`` (key -> what its rows say: settings, kind, O_DIRECT,
    files read, version), ``failed`` (key -> why) and ``order``; ``direct``: whether each
    method's loads read with O_DIRECT; ``scan``: the many-entry scan's targets.
    """
    nbytes = run_info["bytes"]
    lim = _limits(limits, nbytes)
    if times.get("safetensors", {}).get("lazy"):
        s = _stats(times["safetensors"]["lazy"])
        lim["safetensors_lazy"] = {**s, "gbps": nbytes / s["median_s"] / 1e9, "label": LIMIT_LABELS["safetensors_lazy"]}
    rows = _rows(times, lim, nbytes, methods, peers, direct or {})
    doc = {"run": run_info, "limits": lim, "rows": rows, "memory": memory, "peers": peers, "scan": scan,
           "raw_times": times}
    doc["targets"] = evaluate(doc)
    return doc


def _fmt(x: float | None, spec: str, suffix: str = "") -> str:
    return "-" if x is None else f"{x:{spec}}{suffix}"


_W = 13 + 36  # phase and method (or a limit's label): the longest limit label, with a space
_SHORT = {"copy": "copy_", "write_buffered": "write, buffered", "disk_best": "best disk read",
          "safetensors_lazy": "load_file"}


def row_prefix(phase: str, method: str) -> str:
    """How a row of the table starts: its phase and method, padded."""
    return f"{PHASES[phase][0]:<13}{method:<{_W - 13}}"


def _table_rows(doc: dict[str, Any]) -> list[str]:
    head = (f"{'phase':<13}{'method':<{_W - 13}}{'median s':>9}{'min':>8}{'max':>8}{'GB/s':>7}  {'of limit':>8} "
            f"{'limit':<16}{'O_DIRECT':>8}{'vs DCP':>8}  {'returns':<8}{'reads'}")
    lines = [head, "-" * (len(head) + 4)]
    for name, s in doc["limits"].items():
        if name not in ("safetensors_lazy", "disk_best"):
            lines.append(f"{'limit: ' + s['label']:<{_W}}{s['median_s']:>9.3f}{s['min_s']:>8.3f}"
                         f"{s['max_s']:>8.3f}{s['gbps']:>7.2f}")
    for r in doc["rows"]:
        direct = _fmt(r.get("fraction_of_direct"), ".2f") if r["phase"] == "save" else ""
        reads = "" if r.get("direct") is None else ("O_DIRECT" if r["direct"] else "buffered")
        lines.append(f"{row_prefix(r['phase'], r['method'])}{r['median_s']:>9.3f}{r['min_s']:>8.3f}"
                     f"{r['max_s']:>8.3f}{r['gbps']:>7.2f}  {_fmt(r['fraction_of_limit'], '8.2f'):>8} "
                     f"{_SHORT.get(r['limit'], r['limit']):<16}{direct:>8}{_fmt(r['ratio_to_dcp'], '7.2f', 'x'):>8}  "
                     f"{r.get('returns') or '':<8}{reads}".rstrip())
    best = doc["limits"].get("disk_best")
    if best:
        lines.append(f"cold rows: 'of limit' is against the best disk read of this run, {best['label']}, "
                     f"{best['gbps']:.2f} GB/s (the JSON has each row's fraction of the one-stream read too)")
    return lines


#: Why a save can reach several times its limit, printed under the table.
SAVE_NOTE = ("save rows: 'of limit' is against a buffered write+fsync of as many bytes (the page cache's write "
             "path), 'O_DIRECT' against an O_DIRECT write+fsync, the path mmapckpt's shards take; above 1 of the "
             "buffered limit is that difference, not a measurement error")
#: What the returns column says.
RETURNS_NOTE = ("returns: fill = copied into preallocated targets; new = new tensors; views = tensors over the "
                "loader's own buffer (new tensors and views of peers are touched, one byte a page, inside the "
                "timed call); reads: whether the load reads with O_DIRECT or through the page cache")


_RETURNS = {"fill": "filled targets", "new": "new tensors", "views": "views"}


def _peer_lines(doc: dict[str, Any]) -> list[str]:
    peers = doc.get("peers")
    if not peers:
        return []
    lines = ["", "peers (each in a process of its own, with the settings its documentation gives for speed):"]
    for key in peers["order"]:
        if key in peers["failed"]:
            lines.append(f"  {key}: skipped: {peers['failed'][key]}")
            continue
        i = peers["run"][key]
        extra = "".join(f"; {k.replace('_', ' ')} used: {i[k]}" for k in ("num_readers", "strategy") if i.get(k))
        lines.append(f"  {key}: {i['label']} ({i['version']}): {i['settings']}; reads "
                     f"{', '.join(i['reads'])}; returns {_RETURNS[i['kind']]}{extra}")
        if i.get("mismatch"):
            lines.append(f"  {key}: WRONG DATA in {', '.join(i['mismatch'])}")
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
    lines.append(RETURNS_NOTE)
    lines += _peer_lines(doc)
    if doc["memory"]:
        lines += ["", f"{'memory added by a warm load into targets':<44}{'peak RSS':>10}{'peak anon':>11}{'anon after':>11}"]
        for m, v in doc["memory"].items():
            lines.append(f"{m:<44}{_fmt(v['peak_rss_added'] and v['peak_rss_added'] / 2**20, '8.1f', 'MB'):>10}"
                         f"{v['peak_anon_added'] / 2**20:>9.1f}MB{v['anon_added_after'] / 2**20:>9.1f}MB")
    lines += render_targets(doc["targets"], targets)
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
    peers = {r["method"] for r in doc["rows"] if r.get("peer")}
    fig, ax = plt.subplots(figsize=(12, 5))
    width = 0.8 / max(1, len(methods))
    for j, m in enumerate(methods):
        vals = [next((r["gbps"] for r in doc["rows"] if r["method"] == m and r["phase"] == p), 0) for p in phases]
        ax.bar([i + j * width for i in range(len(phases))], vals, width, label=m, hatch="//" if m in peers else None)
    for i, p in enumerate(phases):
        lim = doc["limits"].get(PHASES[p][1])
        if lim:
            ax.hlines(lim["gbps"], i - width / 2, i + 0.8 - width / 2, colors="k", linestyles="dashed")
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(phases))], [PHASES[p][0] for p in phases])
    ax.set_ylabel("GB/s (median); dashed: the phase's limit")  # cold: the best disk read
    ax.set_title(f"{doc['run']['bytes'] / 1e9:.2f} GB, {doc['run']['tensors']} tensors")
    ax.legend(fontsize="small", ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_json(out: str | None, name: str, doc: object) -> str | None:
    """Write ``doc`` to ``out/name`` and say so; nothing (None) without ``--out``."""
    if out is None:
        return None
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, name)
    with open(path, "w") as f:
        json.dump(doc, f, indent=2)
    print(f"\nJSON: {path}")
    return path
