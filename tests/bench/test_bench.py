"""The benchmark runs at a tiny size and produces every row and valid JSON (no timing is asserted)."""

from __future__ import annotations

import argparse
import json
import math
import os

import pytest

from mmapckpt.bench import runner as bench
from mmapckpt.bench import targets
from mmapckpt.bench.methods import METHODS, lazy_note
from mmapckpt.bench.peers import PEER_KEYS
from mmapckpt.bench.report import PHASES, row_prefix


def _args(tmp_path, *extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args(["--quick", "--size", "2MB", "--tensors", "13", "--out", str(tmp_path / "out"),
                              "--dir", str(tmp_path / "work"), "--threads", "1", *extra])


def _positive(x: object) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


@pytest.mark.slow  # a child process per method for the memory rows, one per peer: ~60 s on a busy 2-core machine
def test_quick_run_produces_every_row_and_valid_json(tmp_path, capsys) -> None:
    assert bench.run(_args(tmp_path, "--repeats", "2", "--targets")) == 0
    out = capsys.readouterr().out
    doc = json.loads((tmp_path / "out" / "bench.json").read_text())

    # every method, every phase it supports, with two timings each
    expected = {(m.key, p) for m in METHODS for p in ("save", "warm", "cold")}
    expected |= {(m.key, "lazy") for m in METHODS if m.lazy is not None and not (m.key == "mmapckpt" and lazy_note())}
    expected |= {(k, p) for k in PEER_KEYS for p in ("warm", "cold")}  # the peers, by default
    got = {(r["method"], r["phase"]) for r in doc["rows"]}
    assert got == expected
    for r in doc["rows"]:
        assert r["n"] == 2 and r["min_s"] <= r["median_s"] <= r["max_s"], r
        assert _positive(r["gbps"]) and _positive(r["fraction_of_limit"]) and _positive(r["ratio_to_dcp"] or 1.0)
        assert r["limit"] == PHASES[r["phase"]][1]
    dcp_rows = [r for r in doc["rows"] if r["method"] == "dcp"]
    assert all(r["ratio_to_dcp"] == 1.0 for r in dcp_rows)

    # the limits, each measured twice on as many bytes as the state dict
    assert {"copy", "write_buffered", "write_direct", "cold_read", "disk_best", "read_direct_x16",
            "read_buffered_x2", "read_direct_files_x4"} <= set(doc["limits"])
    assert all(v["n"] == 2 and _positive(v["gbps"]) for k, v in doc["limits"].items() if k != "safetensors_lazy")

    # memory of a load into targets, in a child process per method
    assert set(doc["memory"]) == {m.key for m in METHODS}
    for v in doc["memory"].values():
        assert v["targets_bytes"] == doc["run"]["bytes"] and v["peak_anon_added"] >= -(1 << 20)

    run = doc["run"]
    assert run["tensors"] == 13 and run["bytes"] > 1_000_000 and run["repeats"] == 2
    assert all(run["correct"].values()) and set(run["correct"]) == {m.key for m in METHODS} | set(PEER_KEYS)
    assert set(run["write_paths"]) == {"mmapckpt", "mmapckpt-api", "mmapckpt-fast"}
    assert all(set(v) <= {"direct", "buffered"} for v in run["write_paths"].values())
    # every target of the issue is measured, but the scan's (not run by --quick)
    assert len(doc["targets"]) == len(targets.FRACTIONS) + 4 * len(targets.PEER_FAMILIES) + 1
    assert [t["target"] for t in doc["targets"] if t["met"] is None] == ["many-entry scan: its targets"]

    # the table shows every row and every limit; the temporary checkpoints are gone
    for r in doc["rows"]:
        assert row_prefix(r["phase"], r["method"]) in out
    assert "limit: cold read, 1 buffered stream" in out and "against the targets" in out
    assert not [n for n in os.listdir(tmp_path / "work") if n.startswith(".mmapckpt-bench-")]


def test_method_subset_without_memory(tmp_path, capsys) -> None:
    assert bench.run(_args(tmp_path, "--methods", "mmapckpt,safetensors", "--no-memory")) == 0
    doc = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert {r["method"] for r in doc["rows"]} == {"mmapckpt", "safetensors"}
    assert all(r["ratio_to_dcp"] is None for r in doc["rows"])  # no stock DCP row to compare with
    assert doc["memory"] == {}


def test_bad_options_exit_2(tmp_path, capsys) -> None:
    assert bench.run(_args(tmp_path, "--dtype", "float17")) == 2
    assert bench.run(_args(tmp_path, "--methods", "nothing")) == 2
    assert bench.run(_args(tmp_path, "--repeats", "0")) == 2
    assert "mmapckpt bench:" in capsys.readouterr().err


def test_cuda_benchmark_says_why_without_a_gpu() -> None:
    import subprocess
    import sys

    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the script would run the real benchmark")
    script = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "benchmarks", "cuda_bench.py")
    proc = subprocess.run([sys.executable, script, "--size", "8MB"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert "no CUDA device is available" in proc.stderr and "nothing was measured" in proc.stderr


def test_cuda_benchmark_smoke_runs_every_row_on_the_cpu(tmp_path) -> None:
    """`--device cpu`: the accelerator benchmark's code with CPU targets, every load checked bitwise."""
    import subprocess
    import sys

    script = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "benchmarks", "cuda_bench.py")
    out = tmp_path / "cuda_bench.json"
    proc = subprocess.run([sys.executable, script, "--device", "cpu", "--size", "8MB", "--repeats", "1",
                           "--out", str(out), "--dir", str(tmp_path)], capture_output=True, text=True, timeout=300,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["device"] == "cpu" and doc["smoke"] and not doc["ratios_meaningful"] and "mean nothing" in doc["note"]

    loads = ["mmapckpt-dcp", "mmapckpt-load_into", "mmapckpt-load", "mmapckpt-registered", "dcp", "safetensors", "torch"]
    if "fastsafetensors" not in doc["skipped"]:  # measured only where it imports
        loads.append("fastsafetensors")
    got = {(r["method"], r["phase"]) for r in doc["rows"]}
    assert got == {(m, p) for m in loads for p in ("warm", "cold")} | {("mmapckpt", "save"), ("dcp", "save")}
    assert doc["checked_bitwise"] == {m: True for m in loads}
    for r in doc["rows"]:
        assert r["n"] == 1 and r["min_s"] <= r["median_s"] <= r["max_s"] and _positive(r["gbps"]), r
        if r["phase"] == "save":
            assert r["ratio"] is None
        else:
            assert _positive(r["ratio"]) and _positive(r["limit_s"]) and r["limit"]
    assert {(t["method"], t["phase"]) for t in doc["targets"]} == {
        (m, p) for m in ("mmapckpt-dcp", "mmapckpt-load_into", "mmapckpt-load") for p in ("warm", "cold")}
    assert all(isinstance(t["met"], bool) and t["meaningful"] is False for t in doc["targets"])
    assert _positive(doc["limits"]["h2d"]["gbps"])
    assert set(doc["limits"]["cold_read"]) == {"mmapckpt", "dcp", "safetensors", "torch"}
    assert doc["bytes"] > 1_000_000 and doc["repeats"] == 1
    assert set(doc["limits"]["disk"]) <= {"direct_x1", "direct_x8", "buffered_x4"} and "buffered_x4" in doc["limits"]["disk"]
    # the smoke run stages its CPU targets: each staged mmapckpt load reports its pools' counters
    assert {"warm mmapckpt-dcp", "warm mmapckpt-load_into", "cold mmapckpt-dcp", "cold mmapckpt-load_into"} <= set(
        doc["staging"])
    assert all(st["buffers"] >= 1 and st["fill_s"] > 0 and st["load_s"] > 0 for st in doc["staging"].values())
    rings = doc["staging_sweep"]
    assert [(r["buffers"], r["bytes"]) for r in rings] == [(2, 1 << 20), (3, 1 << 20)]
    assert all(r["sealed"] >= doc["bytes"] / (1 << 20) and _positive(r["gbps"]) for r in rings)
    sweep = doc["fill_sweep"]
    assert isinstance(sweep["cached_probe"], bool) and [r["threads"] for r in sweep["rows"]] == [1, 2]
    assert all(_positive(r["fill_gbps"]) and _positive(r["load_into_gbps"]) for r in sweep["rows"])
    for label in ("dcp.load + MmapReader", "mmapckpt.load_into", "safetensors load_file", "against the targets"):
        assert label in proc.stdout
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".mmapckpt-cuda-bench-")]  # cleaned up


def _finite(x: object) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_adam_state_dict_has_two_moments_and_a_step_per_parameter() -> None:
    from mmapckpt.bench.entries import adam_state_dict, flatten_tensors

    sd = adam_state_dict(3)
    flat, leaves, dropped = flatten_tensors(sd)
    assert len(sd["model"]) == 36 and len(flat) == 4 * 36 and dropped == leaves - len(flat) > 0
    for state in sd["optim"]["state"].values():
        assert set(state) == {"exp_avg", "exp_avg_sq", "step"} and state["step"].dim() == 0
