"""Many-entry checkpoints for the scan (bench/scan.py): the Adam case, per-entry costs, their ratios to
safetensors and the issue's targets (the table and the chart: ``benchmarks/scan_bench.py``).

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

__all__ = ["adam_state_dict", "flatten_tensors", "targets_like", "same_values", "summarize",
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
