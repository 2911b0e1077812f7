"""benchmarks/cuda_register_bench.py: says why without a GPU; its `--device cpu` smoke mode runs every row."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

SCRIPT = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "benchmarks", "cuda_register_bench.py")


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and x > 0


def test_register_benchmark_says_why_without_a_gpu() -> None:
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the script would run the real benchmark")
    proc = subprocess.run([sys.executable, SCRIPT, "--size", "8MB"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert "no CUDA device is available" in proc.stderr and "nothing was measured" in proc.stderr


def test_register_benchmark_smoke_runs_every_row_on_the_cpu(tmp_path) -> None:
    out = tmp_path / "register.json"
    proc = subprocess.run([sys.executable, SCRIPT, "--device", "cpu", "--size", "8MB", "--windows", "1MiB,4MiB",
                           "--repeats", "2", "--out", str(out), "--dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["device"] == "cpu" and doc["smoke"] and not doc["ratios_meaningful"] and "mean nothing" in doc["note"]
    assert doc["bytes"] == 8_000_000 and doc["repeats"] == 2 and doc["checked_bitwise"] is True
    assert doc["windows"] == [1 << 20, 4 << 20]
    # 8 MB from a page-aligned address: 8 or 9 tiles of 1 MiB, 2 or 3 of 4 MiB, one for the whole file
    tiles = {r["window"]: r["tiles"] for r in doc["register"]}
    assert tiles["1 MiB"] in (8, 9) and tiles["4 MiB"] in (2, 3) and tiles["whole file"] == 1
    assert all(_positive(r["register_s_per_gb"]) and _positive(r["unregister_s_per_gb"]) for r in doc["register"])
    assert set(doc["copies"]) == {"pinned buffer (limit)", "registered mapping", "pageable mapping"}
    assert doc["copies"]["pinned buffer (limit)"]["ratio"] == 1.0
    for r in doc["copies"].values():
        assert r["n"] == 2 and r["min_s"] <= r["median_s"] <= r["max_s"] and _positive(r["gbps"]), r
    assert {(r["mode"], r["window_bytes"]) for r in doc["end_to_end"]} == {
        (m, w) for m in ("sequential", "pipelined") for w in (1 << 20, 4 << 20)}
    assert all(_positive(r["ratio"]) and r["n"] == 2 for r in doc["end_to_end"])
    for label in ("registration window", "registered mapping", "pipelined", "mean nothing"):
        assert label in proc.stdout
