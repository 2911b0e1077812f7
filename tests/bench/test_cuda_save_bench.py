"""benchmarks/cuda_save_bench.py: it says why without a GPU, and its CPU smoke mode runs every row."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

SCRIPT = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "benchmarks", "cuda_save_bench.py")


def _positive(x: object) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def _env() -> dict[str, str]:
    root = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))
    return {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}


def test_cuda_save_benchmark_says_why_without_a_gpu() -> None:
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the script would run the real benchmark")
    proc = subprocess.run([sys.executable, SCRIPT, "--size", "8MB"], capture_output=True, text=True, timeout=120,
                          env=_env())
    assert proc.returncode == 2 and proc.stdout == ""
    assert "no CUDA device is available" in proc.stderr and "nothing was measured" in proc.stderr


def test_cuda_save_benchmark_smoke_runs_every_row_on_the_cpu(tmp_path) -> None:
    out = tmp_path / "cuda_save_bench.json"
    proc = subprocess.run([sys.executable, SCRIPT, "--device", "cpu", "--size", "8MB", "--repeats", "2",
                           "--out", str(out), "--dir", str(tmp_path)], capture_output=True, text=True, timeout=300,
                          check=False, env=_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["device"] == "cpu" and doc["smoke"] and not doc["ratios_meaningful"] and "mean nothing" in doc["note"]
    got = {(r["phase"], r["method"]) for r in doc["rows"]}
    assert got == {("blocked", "dcp-default"), ("blocked", "pinned-stager-first"), ("blocked", "pinned-stager"),
                   ("save", "mmapckpt")}
    assert "dcp-pinned" in doc["skipped"]  # DCP's pinned stager needs an accelerator
    # every staged save was loaded back bitwise, after the source changed right after async_save returned
    assert doc["checked_bitwise"] == {"dcp-default": True, "pinned-stager-first": True, "save": True}
    for r in doc["rows"]:
        n = 1 if r["method"].endswith("-first") else 2
        assert r["n"] == n and r["min_s"] <= r["median_s"] <= r["max_s"], r
        assert _positive(r["gbps"]) and _positive(r["ratio"]) and _positive(r["limit_s"]) and r["limit"], r
    assert {(t["phase"], t["method"]) for t in doc["targets"]} == {("blocked", "pinned-stager"), ("save", "mmapckpt")}
    assert all(isinstance(t["met"], bool) and t["meaningful"] is False for t in doc["targets"])
    assert _positive(doc["limits"]["d2h"]["gbps"]) and _positive(doc["limits"]["write"]["gbps"])
    assert "write+fsync" in doc["limits"]["write"]["label"]
    assert doc["bytes"] > 1_000_000 and doc["repeats"] == 2
    for label in ("no stager (DCP's default)", "PinnedStager: steady", "against the targets", "meaningless"):
        assert label in proc.stdout
