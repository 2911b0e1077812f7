"""What `mmapckpt bench` writes and prints: JSON only under --out; targets in one line or listed; the save rows'
O_DIRECT limit beside the buffered one (no timing is asserted)."""

from __future__ import annotations

import argparse
import json
import os

from mmapckpt.bench import runner as bench
from mmapckpt.bench.report import SAVE_NOTE, row_prefix
from mmapckpt.bench.targets import SUMMARY


def _args(tmp_path, *extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args(["--quick", "--size", "1MB", "--tensors", "13", "--dir", str(tmp_path / "work"),
                              "--threads", "1", "--methods", "mmapckpt,dcp", "--no-memory", *extra])


def test_no_file_is_written_without_out(tmp_path, monkeypatch, capsys) -> None:
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    assert bench.run(_args(tmp_path)) == 0
    out = capsys.readouterr().out
    assert os.listdir(cwd) == [] and os.listdir(tmp_path / "work") == []
    assert "JSON:" not in out and "chart:" not in out

    assert bench.run(_args(tmp_path, "--out", str(tmp_path / "res"))) == 0
    out = capsys.readouterr().out
    assert os.listdir(cwd) == [] and "bench.json" in os.listdir(tmp_path / "res")
    assert f"JSON: {tmp_path / 'res' / 'bench.json'}" in out
    doc = json.loads((tmp_path / "res" / "bench.json").read_text())
    assert {r["method"] for r in doc["rows"]} == {"mmapckpt", "dcp"} and doc["targets"]


def test_targets_one_line_unless_listed(tmp_path, capsys) -> None:
    assert bench.run(_args(tmp_path)) == 0
    lines = capsys.readouterr().out.splitlines()
    one = [line for line in lines if line.startswith("targets: ")]
    assert len(one) == 1 and " met" in one[0] and "--targets lists them" in one[0] and SUMMARY in one[0]
    assert "mmapckpt against the targets:" not in lines

    assert bench.run(_args(tmp_path, "--targets")) == 0
    lines = capsys.readouterr().out.splitlines()
    assert not any(line.startswith("targets: ") for line in lines)
    listed = lines[lines.index("mmapckpt against the targets:") + 1:]
    save = next(line for line in listed if line.startswith("  save: dcp.save + MmapWriter >= 1.0 of an O_DIRECT "))
    cold = next(line for line in listed if line.startswith("  cold: dcp.load + MmapReader >= 0.95 of the best disk "))
    assert save.endswith(("met", "MISSED")) and cold.endswith(("met", "MISSED"))
    assert "  cold: load_into >= 0.95 of the best disk read: not measured (mmapckpt-api was not run " \
           "(add it to --methods))" in listed


def test_save_rows_show_the_o_direct_limit_beside_the_buffered_one(tmp_path, capsys) -> None:
    assert bench.run(_args(tmp_path, "--out", str(tmp_path / "res"))) == 0
    lines = capsys.readouterr().out.splitlines()
    doc = json.loads((tmp_path / "res" / "bench.json").read_text())
    head = next(line for line in lines if line.startswith("phase "))
    col = head.index("O_DIRECT")
    assert "limit: write+fsync, O_DIRECT" in "\n".join(lines) and SAVE_NOTE in lines
    for r in doc["rows"]:
        row = next(line for line in lines if line.startswith(row_prefix(r["phase"], r["method"])))
        cell = row[col:col + 8].strip()
        if r["phase"] == "save" and "fraction_of_direct" in r:
            assert cell == f"{r['fraction_of_direct']:.2f}", (row, head)
        elif r["phase"] != "save":
            assert cell == "", row


def test_the_many_entry_scan_targets_are_in_the_targets_section(tmp_path, capsys) -> None:
    """--scan-entries: the scan runs after the comparison and every one of its targets is listed with the rest."""
    from mmapckpt.bench.entries import TARGETS as SCAN_TARGETS

    assert bench.run(_args(tmp_path, "--targets", "--scan-entries", "30", "--adam-layers", "1",
                           "--out", str(tmp_path / "res"))) == 0
    out = capsys.readouterr().out
    doc = json.loads((tmp_path / "res" / "bench.json").read_text())
    assert doc["scan"]["tensors"] == 30 and doc["scan"]["correct"] is True
    scan = [t for t in doc["targets"] if t["phase"] == "scan"]
    assert {t["target"].split(": ", 1)[1] for t in scan} == {text for *_, text in SCAN_TARGETS}
    assert {t["target"].split(",")[1].split(":")[0].strip() for t in scan} == {"transformer 33 tensors",
                                                                               "adam 48 tensors"}
    assert all(isinstance(t["met"], bool) and t["met"] == (t["measured"] <= t["at_most"]) for t in scan)
    for t in scan:
        assert f"  {t['target']}: {t['measured']:.2f}, at most {t['at_most']}: " in out
    assert not [n for n in os.listdir(tmp_path / "work") if n.startswith(".mmapckpt-")]
