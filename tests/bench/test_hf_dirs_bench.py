"""``python benchmarks/hf_dirs_bench.py`` runs at a tiny size: every reader and phase timed, every load checked (no timing asserted)."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import bench_script

hf_dirs = bench_script("hf_dirs_bench")


def test_a_quick_run_prints_every_reader_and_writes_json(tmp_path, capsys) -> None:
    assert hf_dirs.main(["--quick", "--size", "2MB", "--tensors", "13", "--repeats", "2",
                         "--out", str(tmp_path / "out"), "--dir", str(tmp_path / "work"), "--threads", "1"]) == 0
    out = capsys.readouterr().out
    doc = json.loads((tmp_path / "out" / "hf-dirs.json").read_text())
    assert doc["run"]["files"] == hf_dirs.FILES
    assert doc["run"]["correct"] == {"mmapckpt": True, "mmapckpt-fast": True, "hf-stock": True}
    for key, label in doc["labels"].items():
        for phase in ("warm", "cold"):
            assert len(doc["times"][key][phase]) == 2
            assert any(line.startswith(label) and f" {phase} " in line for line in out.splitlines()), (key, phase)
    assert "DCP planning and headers" in out and "every load checked bit for bit: ok" in out
    assert not list((tmp_path / "work").iterdir())  # the run's directory is removed


def test_a_reader_that_loads_wrong_bytes_is_reported(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = hf_dirs.READERS["mmapckpt"]

    def wrong(targets, path) -> None:
        real[1](targets, path)
        next(iter(targets.values())).view(torch.uint8)[0] ^= 1

    monkeypatch.setitem(hf_dirs.READERS, "mmapckpt", (real[0], wrong, True))
    doc = hf_dirs.run_hf_dirs(size=1 << 20, dtype=torch.bfloat16, layers=1, repeats=1, bench_dir=str(tmp_path),
                              log=lambda s: None)
    assert doc["run"]["correct"]["mmapckpt"] is False and doc["run"]["correct"]["hf-stock"] is True
    assert "WRONG DATA from mmapckpt" in hf_dirs.render(doc)
