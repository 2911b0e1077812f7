"""``mmapckpt bench --replicas``: a tiny replicated load on 2 gloo ranks, through the CLI."""

from __future__ import annotations

import json
import os

import pytest

from mmapckpt.tools.cli import main

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]


def test_bench_replicas_reports_bytes_read_and_bitwise_loads(tmp_path, capsys) -> None:
    out = tmp_path / "out"
    assert main(["bench", "--replicas", "2", "--size", "2MB", "--repeats", "1", "--out", str(out),
                 "--dir", str(tmp_path)]) == 0
    doc = json.loads((out / "replicas.json").read_text())
    rows = doc["rows"]
    assert doc["replicas"] == 2 and doc["stored_bytes"] > 1_000_000
    assert rows["plain"]["x_checkpoint"] == 2.0 and rows["read_once"]["x_checkpoint"] == 1.0
    assert rows["plain"]["correct"] and rows["read_once"]["correct"]
    assert len(rows["read_once"]["seconds"]) == 1
    assert "MmapReader(read_once)" in capsys.readouterr().out
    assert not [n for n in os.listdir(tmp_path) if n.startswith("mmapckpt-replicas-")]  # its checkpoint is gone


def test_bench_replicas_needs_two_ranks(tmp_path) -> None:
    assert main(["bench", "--replicas", "1", "--out", str(tmp_path)]) == 2
