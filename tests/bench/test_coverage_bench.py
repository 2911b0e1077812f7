"""``python benchmarks/coverage_bench.py``: what the index checks cost per chunk, beside the decode."""

from __future__ import annotations

import os

import pytest
from helpers import bench_script

from mmapckpt.format.metadata import v2
from mmapckpt.storage.commits import read_index_file

coverage = bench_script("coverage_bench")


def test_a_quick_run_prints_every_layout(capsys) -> None:
    assert coverage.main(["--chunks", "16", "--entries", "50", "--repeats", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    rows = {line[:26].strip(): line[26:].split() for line in out[2:]}
    assert list(rows) == ["one tensor, row chunks", "one tensor, grid of blocks", "whole tensors (bulk)"]
    assert rows["one tensor, row chunks"][0] == "16" and rows["whole tensors (bulk)"][0] == "50"
    assert all(float(x) > 0 for r in rows.values() for x in r[1:3])  # decode and unchecked decode, us per chunk


def test_the_written_layout_is_what_the_decoder_reads_and_the_no_op_is_undone(tmp_path) -> None:
    path = os.path.join(tmp_path, ".metadata")
    rows = [((i, 0), (1, 3)) for i in range(5)]
    coverage.write_layout(path, rows, (5, 3), tensors=2)
    _, entries, _ = read_index_file(path)
    assert [(c.offsets, c.sizes) for c in entries["layer1.weight"].chunks] == rows
    checker = v2.check_entries
    times = coverage.measure_layout(path, rows, (5, 3), 1)
    assert set(times) == {"decode", "unchecked", "tiling"} and v2.check_entries is checker
    coverage.write_layout(path, rows[:4], (5, 3))  # a gap: the real check is back in place
    with pytest.raises(Exception, match="hold 12 of the tensor's 15"):
        read_index_file(path)
