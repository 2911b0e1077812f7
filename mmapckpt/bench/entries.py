"""Many-entry checkpoints for ``mmapckpt bench --scan tensors``: the Adam case, per-entry costs,
their ratios to safetensors, the issue's targets, the table and the chart.

Per-entry cost at a point is the median seconds of an operation divided by the tensor
count of the state dict (the same divisor for every method, so a ratio of per-entry
costs is a ratio of seconds). Every operation is compared with safetensors' counterpart
at the same point: a save with ``save_file``, a load into targets with ``load_file`` +
``copy_``, a load of the whole state dict with ``load_file``, open + every ``get_tensor``
with ``safe_open`` + every ``get_tensor``.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import torch

__all__ = ["adam_state_dict", "flatten_tensors", "targets_like", "same_values", "summarize", "render", "plot",
           "TARGETS", "PHASE_LABELS"]

#: phase -> what it is, in the table and the chart
PHASE_LABELS = {"save": "save (fsync)", "plan_save": "dcp.save planning only", "warm": "warm load into targets",
                "plan": "dcp.load planning only", "lazy": "load the whole state dict",
                "open": "open + every get_tensor"}
#: (method, phase, reference method, reference phase, the most the ratio may be, wording): the issue's targets
TARGETS: tuple[tuple[str, str, str, str, float, str], ...] = (
    ("mmapckpt-api", "save", "safetensors", "save", 1.0, "mmapckpt.save <= save_file"),
    ("mmapckpt-api", "lazy", "safetensors", "lazy", 1.0, "mmapckpt.load <= load_file"),
    ("mmapckpt-api", "open", "safetensors", "open", 1.0, "mmapckpt.open+get_tensor <= safe_open+get_tensor"),
    ("mmapckpt-api", "warm", "safetensors", "warm", 1.0, "mmapckpt.load_into <= load_file+copy_"),
    ("mmapckpt-fast", "warm", "mmapckpt-api", "warm", 2.0, "dcp.load, FastLoadPlanner <= 2x mmapckpt.load_into"),
    ("mmapckpt-fast", "save", "mmapckpt-api", "save", 2.0, "dcp.save, FastSavePlanner <= 2x mmapckpt.save"),
    ("mmapckpt-fast-model", "warm", "mmapckpt-api", "warm", 2.0,
     "dcp.load {model: sd}, FastLoadPlanner <= 2x load_into"),
    ("mmapckpt-fast-model", "save", "mmapckpt-api", "save", 2.0,
     "dcp.save {model: sd}, FastSavePlanner <= 2x mmapckpt.save"),
)


def adam_state_dict(layers: int, *, d_model: int = 16, seed: int = 0) -> dict[str, Any]:
    """``{"model": ..., "optim": ...}`` from ``get_state_dict`` of a small ``nn.TransformerEncoder``
    (``layers`` layers of 12 parameters) and its Adam optimizer after one step: per parameter
    the weight, ``exp_avg``, ``exp_avg_sq`` and a 0-d ``step`` tensor (48 tensors a layer), plus
    the param group's non-tensor values (floats, bools, the list of parameter names).
    """
    from torch import nn
    from torch.distributed.checkpoint.state_dict import get_state_dict

    gen = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        layer = nn.TransformerEncoderLayer(d_model=d_model, nhead=2, dim_feedforward=2 * d_model, dropout=0.0,
                                           batch_first=True)
        model = nn.TransformerEncoder(layer, num_layers=layers, enable_nested_tensor=False)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(2, 4, d_model, generator=gen)).square().mean().backward()
    opt.step()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        msd, osd = get_state_dict(model, opt)
    return {"model": {k: v.detach().clone() for k, v in msd.items()}, "optim": osd}


def _walk(obj: Any, prefix: str):  # type: ignore[no-untyped-def]
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _walk(v, f"{prefix}{k}.")
    elif isinstance(obj, (list, tuple)) and any(isinstance(v, (dict, list, tuple, torch.Tensor)) for v in obj):
        for i, v in enumerate(obj):
            yield from _walk(v, f"{prefix}{i}.")
    else:
        yield prefix[:-1], obj


def flatten_tensors(sd: dict[str, Any]) -> tuple[dict[str, torch.Tensor], int, int]:
    """The tensors of a nested state dict as ``{"a.b.c": tensor}``, with the count of all leaves
    and of the non-tensor leaves left out (as safetensors and ``mmapckpt.save`` need)."""
    leaves = list(_walk(sd, ""))
    flat = {k: v for k, v in leaves if isinstance(v, torch.Tensor)}
    return flat, len(leaves), len(leaves) - len(flat)


def targets_like(sd: Any) -> Any:
    """The same nesting with every tensor replaced by a zeroed one of its shape and dtype."""
    if isinstance(sd, torch.Tensor):
        return torch.zeros_like(sd)
    if isinstance(sd, dict):
        return {k: targets_like(v) for k, v in sd.items()}
    if isinstance(sd, list):
        return [targets_like(v) for v in sd]
    return copy.deepcopy(sd)


def same_values(a: Any, b: Any) -> bool:
    """Bitwise equality of two nested state dicts (tensors by bytes, other values by ``==``)."""
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_values(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return (isinstance(b, (list, tuple)) and len(a) == len(b)
                and all(same_values(x, y) for x, y in zip(a, b)))
    return bool(a == b)


def _point_key(r: dict[str, Any]) -> tuple[str, int]:
    return r["case"], r["tensors"]


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-entry costs, every one's ratio to safetensors' counterpart, and the targets, per point."""
    by = {(r["case"], r["tensors"], r["method"]): r for r in rows}
    ratios, targets = [], []
    for r in rows:
        ref = by.get((r["case"], r["tensors"], "safetensors"))
        for ph in PHASE_LABELS:
            us = r.get(f"{ph}_us_per_entry")
            if us is None:
                continue
            st = ref.get(f"{ph}_us_per_entry") if ref else None
            ratios.append({"case": r["case"], "tensors": r["tensors"], "method": r["method"], "phase": ph,
                           "op": r["ops"][ph], "us_per_entry": us, "safetensors_op": ref["ops"][ph] if st else None,
                           "ratio_to_safetensors": us / st if st else None})
    for case, n in dict.fromkeys(_point_key(r) for r in rows):
        for m, ph, rm, rph, most, text in TARGETS:
            a, b = by.get((case, n, m), {}).get(f"{ph}_us_per_entry"), by.get((case, n, rm), {}).get(
                f"{rph}_us_per_entry")
            if a is not None and b:
                targets.append({"case": case, "tensors": n, "target": text, "ratio": a / b, "at_most": most,
                                "met": a / b <= most})
    return {"ratios": ratios, "targets": targets, "readers": _readers(rows, by)}


def _readers(rows: list[dict[str, Any]], by: dict[tuple[Any, ...], dict[str, Any]]) -> list[dict[str, Any]]:
    """Per DCP method, point and direction: the storage layer's own cost (the operation less its
    planning-only run) and its ratio to the API's counterpart (``load_into``, ``mmapckpt.save``)."""
    out = []
    for r in rows:
        for op, ph, plan_ph in (("load", "warm", "plan"), ("save", "save", "plan_save")):
            total, plan = r.get(f"{ph}_us_per_entry"), r.get(f"{plan_ph}_us_per_entry")
            if total is None or plan is None:
                continue
            api = by.get((r["case"], r["tensors"], "mmapckpt-api"), {}).get(f"{ph}_us_per_entry")
            out.append({"case": r["case"], "tensors": r["tensors"], "method": r["method"], "op": op,
                        "us_per_entry": total, "plan_us_per_entry": plan, "own_us_per_entry": total - plan,
                        "own_ratio_to_api": (total - plan) / api if api else None})
    return out


def _fmt(x: float) -> str:
    return f"{x:.1f}" if x >= 10 else f"{x:.2f}"


def render(doc: dict[str, Any]) -> list[str]:
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
