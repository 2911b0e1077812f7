"""``mmapckpt bench --hf-dirs`` runs at a tiny size: every reader and phase timed, every load checked (no timing asserted)."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from mmapckpt.bench import hf_dirs
from mmapckpt.bench import runner as bench


def test_a_quick_run_prints_every_reader_and_writes_json(tmp_path, capsys) -> None:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--hf-dirs", "--quick", "--size", "2MB", "--tensors", "13", "--repeats", "2",
                              "--out", str(tmp_path / "out"), "--dir", str(tmp_path / "work"), "--threads", "1"])
    assert bench.run(args) == 0
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
