"""``python benchmarks/scan_bench.py``: the scaling sweeps (time against size and against entry count), their
table and chart; the measurement itself is ``mmapckpt.bench.scan`` (the many-entry targets of ``mmapckpt bench``)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

from helpers import BENCHMARKS, bench_script

scan_bench = bench_script("scan_bench")


def _finite(x: object) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_tensor_scan_reports_every_operation_per_entry_with_ratios_and_targets(tmp_path, capsys) -> None:
    """`scan_bench.py tensors` at tiny sizes: every method's every operation at every point and on the Adam
    state dict, in us per entry, each with its ratio to safetensors, and every target (no timing asserted)."""
    from mmapckpt.bench.entries import PHASE_LABELS
    from mmapckpt.bench.entries import TARGETS as ENTRY_TARGETS
    from mmapckpt.bench.methods import SCAN_METHODS, scan_ops

    assert scan_bench.main(["tensors", "--points", "10,50", "--adam-layers", "2", "--size", "1MB", "--quick",
                            "--out", str(tmp_path / "out"), "--dir", str(tmp_path / "work"), "--threads", "1"]) == 0
    out = capsys.readouterr().out
    doc = json.loads((tmp_path / "out" / "scan-tensors.json").read_text())
    points = [("transformer", 13), ("transformer", 53), ("adam", 96)]  # 2 layers x 48 tensors
    assert {(r["case"], r["tensors"], r["method"]) for r in doc["rows"]} == {
        (c, n, m) for c, n in points for m in SCAN_METHODS}
    for r in doc["rows"]:
        phases = set(scan_ops(r["method"]).ops)
        assert set(r["ops"]) == phases and r["correct"] is True, r
        assert all(_finite(r[f"{p}_s"]) and _finite(r[f"{p}_us_per_entry"]) for p in phases), r
        nested = scan_ops(r["method"]).nested
        assert r["entries"] == (108 if nested and r["case"] == "adam" else r["tensors"])  # + 12 param-group values

    ratios = doc["summary"]["ratios"]
    assert {(q["case"], q["tensors"], q["method"], q["phase"]) for q in ratios} == {
        (c, n, m, p) for c, n in points for m in SCAN_METHODS for p in scan_ops(m).ops}
    for q in ratios:
        assert _finite(q["us_per_entry"]), q
        if q["phase"] in ("plan", "plan_save"):  # DCP's planning alone: safetensors has no counterpart
            assert q["ratio_to_safetensors"] is None and q["safetensors_op"] is None, q
            continue
        assert _finite(q["ratio_to_safetensors"]) and q["safetensors_op"], q
        if q["method"] == "safetensors":
            assert q["ratio_to_safetensors"] == 1.0
    # dcp.load and dcp.save with planning set apart: the storage layer's own cost is the rest
    by = {(r["case"], r["tensors"], r["method"]): r for r in doc["rows"]}
    planned = [m for m in SCAN_METHODS if {"plan", "plan_save"} <= set(scan_ops(m).ops)]
    assert set(planned) == {"mmapckpt", "mmapckpt-fast", "mmapckpt-fast-model"}
    apart = doc["summary"]["readers"]
    assert {(q["case"], q["tensors"], q["method"], q["op"]) for q in apart} == {
        (c, n, m, op) for c, n in points for m in planned for op in ("load", "save")}
    for q in apart:
        r, api = by[(q["case"], q["tensors"], q["method"])], by[(q["case"], q["tensors"], "mmapckpt-api")]
        ph, plan = ("warm", "plan") if q["op"] == "load" else ("save", "plan_save")
        assert q["own_us_per_entry"] == r[f"{ph}_us_per_entry"] - r[f"{plan}_us_per_entry"]
        assert q["own_ratio_to_api"] == q["own_us_per_entry"] / api[f"{ph}_us_per_entry"]
    assert "dcp.load and dcp.save apart" in out
    targets = doc["summary"]["targets"]
    assert {(t["case"], t["tensors"], t["target"]) for t in targets} == {
        (c, n, text) for c, n in points for *_, text in ENTRY_TARGETS}
    assert all(_finite(t["ratio"]) and t["met"] == (t["ratio"] <= t["at_most"]) for t in targets)

    for m in SCAN_METHODS:
        for label, _ in scan_ops(m).ops.values():
            assert label in out
    assert all(PHASE_LABELS[p] in out for p in PHASE_LABELS)
    assert "targets (per-entry ratios)" in out and "bitwise check of every warm load: ok" in out
    assert "12 non-tensor entries" in out  # the Adam case says what safetensors does not get
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "chart: skipped" in out
    else:
        assert (tmp_path / "out" / "scan-tensors.png").stat().st_size > 0
    assert not [n for n in os.listdir(tmp_path / "work") if n.startswith(".mmapckpt-scan-")]


def test_tensor_scan_caps_the_stock_dcp_and_says_so(tmp_path) -> None:
    import torch

    from mmapckpt.bench import scan

    doc = scan.scan("tensors", [10], fixed=200_000, dtype=torch.float32, repeats=1, methods=["safetensors", "dcp"],
                    bench_dir=str(tmp_path), log=lambda s: None, adam_layers=1, dcp_max_entries=20)
    assert {(r["case"], r["method"]) for r in doc["rows"]} == {
        ("transformer", "safetensors"), ("transformer", "dcp"), ("adam", "safetensors")}
    assert any("dcp (stock DCP) skipped at 60 entries" in n for n in doc["notes"])
    assert "skipped at 60 entries" in scan_bench.render(doc)


def test_the_script_runs_by_path_and_refuses_a_bad_option(tmp_path) -> None:
    script = os.path.join(BENCHMARKS, "scan_bench.py")
    proc = subprocess.run([sys.executable, script, "sizes", "--repeats", "0", "--dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--repeats must be at least 1" in proc.stderr, proc.stderr
    proc = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "sizes" in proc.stdout and "--points" in proc.stdout
