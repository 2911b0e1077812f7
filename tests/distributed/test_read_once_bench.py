"""``python benchmarks/replicas_bench.py N``: a tiny replicated load on 2 gloo ranks, the script run by path (its
ranks are spawned from the script itself)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from helpers import BENCHMARKS

SCRIPT = os.path.join(BENCHMARKS, "replicas_bench.py")

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]


def _script(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=200)


def test_bench_replicas_reports_bytes_read_and_bitwise_loads(tmp_path) -> None:
    out = tmp_path / "out"
    proc = _script("2", "--size", "2MB", "--repeats", "1", "--out", str(out), "--dir", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads((out / "replicas.json").read_text())
    rows = doc["rows"]
    assert doc["replicas"] == 2 and doc["stored_bytes"] > 1_000_000
    assert rows["plain"]["x_checkpoint"] == 2.0 and rows["read_once"]["x_checkpoint"] == 1.0
    assert rows["plain"]["correct"] and rows["read_once"]["correct"]
    assert len(rows["read_once"]["seconds"]) == 1
    assert "MmapReader(read_once)" in proc.stdout
    assert not [n for n in os.listdir(tmp_path) if n.startswith("mmapckpt-replicas-")]  # its checkpoint is gone


def test_bench_replicas_needs_two_ranks(tmp_path) -> None:
    proc = _script("1", "--out", str(tmp_path))
    assert proc.returncode == 2 and "at least 2 ranks" in proc.stderr
