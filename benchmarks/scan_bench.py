"""Scaling scans: time against total size, and against entry count (tensor count).

``python benchmarks/scan_bench.py sizes|tensors [--points ...]`` (from a clone of the repository, with
mmapckpt installed or on ``PYTHONPATH``):

- ``sizes``: the same tensor count (``--tensors``) at several total sizes; time should grow linearly,
  so seconds per GB should stay level.
- ``tensors``: the same total bytes (``--size``, default 16MB) split into more and more tensors, and an
  Adam optimizer state dict (``--adam-layers``): every method's operations in microseconds per entry at
  each point, with their ratios to safetensors' counterparts and the issue's targets; also the slope of
  a least-squares line through (count, seconds). With ``--out``, ``scan-KIND.json`` and (``tensors``,
  with matplotlib) ``scan-tensors.png``.

The measurement is ``mmapckpt.bench.scan`` (``mmapckpt bench`` runs it at 10,000 tensors for its
many-entry targets); this script is the sweep, its table and its chart (docs/benchmarks.md, "Many
entries: per-entry cost").
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from mmapckpt.bench import runner
from mmapckpt.bench import scan as bench_scan
from mmapckpt.bench.entries import PHASE_LABELS
from mmapckpt.bench.methods import SCAN_METHODS
from mmapckpt.bench.report import write_json
from mmapckpt.bench.scan import PHASES
from mmapckpt.bench.synthetic import parse_size

PROG = "python benchmarks/scan_bench.py"
_POINTS = {"sizes": "256MB,512MB,1GB,2GB,4GB", "tensors": "10,100,1000,10000"}
_TENSORS_SIZE = "16MB"
_SIZES_TENSORS = 320


def render(doc: dict[str, Any]) -> str:
    """The scan as a text table, with its summary (and, for "tensors", the per-entry table and targets)."""
    phases = [p for p in PHASES if any(f"{p}_s" in r for r in doc["rows"])]
    head = f"{'case':<13}{'method':<15}{'tensors':>9}{'GB':>8}" + "".join(f"{p + ' s':>10}" for p in phases)
    lines = [f"scan: {doc['kind']} (median seconds)", head, "-" * len(head)]
    for r in doc["rows"]:
        lines.append(f"{r.get('case', ''):<13}{r['method']:<15}{r['tensors']:>9}{r['bytes'] / 1e9:>8.3f}"
                     + "".join(f"{r[p + '_s']:>10.4f}" if p + "_s" in r else f"{'-':>10}" for p in phases))
    if doc["kind"] == "tensors":
        lines.append("least-squares slope of seconds against tensor count (transformer points), us per tensor:")
    for k, v in doc["summary"].items():
        if k in ("ratios", "targets", "readers"):
            continue
        val = ", ".join(f"{x:.3f}" for x in v) if isinstance(v, list) else f"{v:.2f}"
        lines.append(f"  {k}: {val}")
    if doc["kind"] == "tensors":
        lines += render_entries(doc)
    bad = [f"{r['method']} ({r.get('case')}, {r['tensors']} t)" for r in doc["rows"] if not r.get("correct", True)]
    lines.append("")
    lines.append("bitwise check of every warm load: " + ("ok" if not bad else "FAILED: " + ", ".join(bad)))
    lines += [f"note: {n}" for n in dict.fromkeys(doc.get("notes", []))]
    return "\n".join(lines)


def _fmt(x: float) -> str:
    return f"{x:.1f}" if x >= 10 else f"{x:.2f}"


def render_entries(doc: dict[str, Any]) -> list[str]:
    """The per-entry table: one line per operation, one column per point (us per entry, x safetensors)."""
    s = doc["summary"]
    points = list(dict.fromkeys((r["case"], r["tensors"]) for r in s["ratios"]))
    if not points:
        return []
    heads = [f"{n} t" if c == "transformer" else f"{c} {n} t" for c, n in points]
    w = max(16, *(len(h) + 2 for h in heads))
    head = f"{'phase':<27}{'method':<20}{'operation':<44}" + "".join(f"{h:>{w}}" for h in heads)
    lines = ["", "per entry: us per tensor entry, median; (x): its ratio to safetensors' counterpart at the point",
             head, "-" * len(head)]
    cells = {(q["case"], q["tensors"], q["method"], q["phase"]): q for q in s["ratios"]}
    ops = list(dict.fromkeys((q["phase"], q["method"], q["op"]) for q in s["ratios"]))
    ops.sort(key=lambda o: list(PHASE_LABELS).index(o[0]))
    for ph, m, op in ops:
        row = f"{PHASE_LABELS[ph]:<27}{m:<20}{op:<44}"
        for c, n in points:
            q = cells.get((c, n, m, ph))
            if q is None:
                row += f"{'-':>{w}}"
            else:
                x = q["ratio_to_safetensors"]
                row += f"{_fmt(q['us_per_entry']) + (f' ({x:.2f}x)' if x is not None else ''):>{w}}"
        lines.append(row)
    if s.get("readers"):
        lines += ["", "dcp.load and dcp.save apart, us per entry: planning (through a reader that resolves and "
                  "commits without copying, a writer that writes nothing: DCP's own code, the planner, the "
                  "metadata decode) and the storage layer's own cost (the operation less its planning; x: its "
                  "ratio to mmapckpt.load_into, mmapckpt.save)"]
        for q in s["readers"]:
            x = q["own_ratio_to_api"]
            own = "reader" if q["op"] == "load" else "writer"
            lines.append(f"  {q['case']:<12}{q['tensors']:>8} t  {q['method']:<20}{q['op']:<5} planning "
                         f"{_fmt(q['plan_us_per_entry'])}, {own} {_fmt(q['own_us_per_entry'])}"
                         + (f" ({x:.2f}x)" if x is not None else ""))
    lines += ["", "targets (per-entry ratios):"]
    for t in s["targets"]:
        lines.append(f"  {t['case']:<12}{t['tensors']:>8} t  {t['target']:<60} {t['ratio']:.2f} "
                     f"(at most {t['at_most']:g}): {'met' if t['met'] else 'MISSED'}")
    return lines


def plot(doc: dict[str, Any], path: str) -> str | None:
    """us per entry against entry count (log-log), one panel per phase; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    qs = doc["summary"]["ratios"]
    phases = [p for p in PHASE_LABELS if any(q["phase"] == p for q in qs)]
    if not phases:
        return None
    from matplotlib.ticker import ScalarFormatter

    cols = min(2, len(phases))
    rows = -(-len(phases) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.6 * cols, 4.2 * rows), squeeze=False)
    for ax in axes.flat[len(phases):]:
        ax.set_visible(False)
    for ax, ph in zip(axes.flat, phases):
        for m in dict.fromkeys(q["method"] for q in qs if q["phase"] == ph):
            line = sorted((q["tensors"], q["us_per_entry"], q["op"]) for q in qs
                          if q["phase"] == ph and q["method"] == m and q["case"] == "transformer")
            adam = [(q["tensors"], q["us_per_entry"]) for q in qs
                    if q["phase"] == ph and q["method"] == m and q["case"] == "adam"]
            label = next(q["op"] for q in qs if q["phase"] == ph and q["method"] == m)
            drawn = ax.plot([x for x, _, _ in line], [y for _, y, _ in line], marker="o", label=label)
            if adam:
                ax.plot(*zip(*adam), marker="*", markersize=12, linestyle="none", color=drawn[0].get_color())
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(ScalarFormatter())
        ax.yaxis.set_minor_formatter(ScalarFormatter())
        ax.tick_params(axis="y", which="minor", labelsize=7)
        ax.set_title(PHASE_LABELS[ph])
        ax.set_xlabel("tensor entries (log); star: the Adam state dict")
        ax.set_ylabel("us per entry (median, log)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, loc="best", framealpha=0.7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def run(args: argparse.Namespace, cfg: dict[str, Any], bench_dir: str) -> int:
    """The sweep: run, print the table, write the JSON (and, for ``tensors``, the chart)."""
    raw = (args.points or _POINTS[args.kind]).split(",")
    points = [parse_size(p) if args.kind == "sizes" else int(p) for p in raw]
    fixed = (args.tensors or _SIZES_TENSORS) if args.kind == "sizes" else parse_size(args.size or _TENSORS_SIZE)
    methods = [m.key for m in cfg["methods"] if m.key in SCAN_METHODS] or ["mmapckpt"]
    cap = bench_scan.DCP_MAX_ENTRIES if args.dcp_max_entries is None else (args.dcp_max_entries or None)
    doc = bench_scan.scan(args.kind, points, fixed=fixed, dtype=cfg["dtype"], repeats=cfg["repeats"],
                          methods=methods, bench_dir=bench_dir, log=lambda s: print(s, file=sys.stderr, flush=True),
                          adam_layers=max(0, args.adam_layers), dcp_max_entries=cap)
    print(render(doc))
    if write_json(args.out, f"scan-{args.kind}.json", doc) and args.kind == "tensors":
        png = plot(doc, os.path.join(args.out, "scan-tensors.png"))
        print(f"chart: {png}" if png else "chart: skipped (install the 'plot' extra: matplotlib)")
    return 0 if all(r.get("correct", True) for r in doc["rows"]) else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("kind", choices=("sizes", "tensors"),
                        help="sizes: time against total size (at --tensors); tensors: against tensor count (at "
                             "--size, default 16MB; plus an Adam optimizer state dict)")
    runner.add_common_arguments(parser)
    parser.add_argument("--points", default=None,
                        help="scan points, comma-separated: sizes (default 256MB,512MB,1GB,2GB,4GB) or "
                             "tensor counts (default 10,100,1000,10000; up to 100000 and more)")
    parser.add_argument("--adam-layers", type=int, default=100,
                        help="tensors: the Adam state dict's model layers, 48 tensors each "
                             "(default 100: 4,800 tensors; 0: no Adam case)")
    parser.add_argument("--dcp-max-entries", type=int, default=None,
                        help="tensors: skip the stock DCP above this many entries (default 20000; 0: never skip)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return runner.drive(args, run, prog=PROG, default_methods=list(SCAN_METHODS))


if __name__ == "__main__":
    sys.exit(main())
