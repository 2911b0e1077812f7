"""``mmapckpt bench --managed`` at a tiny size: every save's row, the fractions, and a bitwise load (no timing asserted)."""

from __future__ import annotations

import argparse
import json

from mmapckpt.bench import command, managed


def test_managed_row_appears_and_last_step_loads_bitwise(tmp_path, capsys) -> None:
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    args = parser.parse_args(["--managed", "--quick", "--size", "2MB", "--tensors", "13", "--threads", "1",
                              "--dir", str(tmp_path / "work"), "--out", str(tmp_path / "out")])
    assert command.run(args) == 0
    out = capsys.readouterr().out
    doc = json.loads((tmp_path / "out" / "bench_managed.json").read_text())

    assert doc["correct"] and doc["frozen"]["correct"] and doc["full"]["correct"]
    assert doc["frozen"]["loaded_step"] == doc["full"]["loaded_step"] == managed.SAVES
    assert 0.05 < doc["changing_bytes"] / doc["bytes"] < 0.15
    for series in ("frozen", "full"):
        assert [r["step"] for r in doc[series]["managed"]] == list(range(1, managed.SAVES + 1))
        assert [r["step"] for r in doc[series]["plain"]] == list(range(1, managed.SAVES + 1))
        assert all(r["seconds"] > 0 for r in doc[series]["managed"] + doc[series]["plain"])
        assert all(r["cpu_seconds"] > 0 for r in doc[series]["managed"] + doc[series]["plain"])
    rows = doc["frozen"]["managed"]
    assert rows[0]["bytes_fraction_of_first"] == 1.0
    # the frozen 90% is stored once: each later step adds about the changing part only (sizes, not times)
    assert all(r["bytes_fraction_of_first"] < 0.2 for r in rows[1:]), rows
    assert all(p["bytes_added"] >= 0.9 * rows[0]["bytes_added"] for p in doc["frozen"]["plain"])
    # a fully changing state dict shares nothing: every managed step is written whole
    assert all(r["bytes_added"] >= 0.9 * doc["full"]["managed"][0]["bytes_added"] for r in doc["full"]["managed"])
    assert doc["full_ratio_managed_to_plain"] > 0 and doc["full_cpu_ratio_managed_to_plain"] > 0
    assert doc["later_cpu_fraction_max"] > 0
    assert "managed saves:" in out and "managed/plain" in out and "fully changing ok" in out and "CPU time:" in out
    assert len([ln for ln in out.splitlines() if ln.split()[:1] in (["1"], ["2"], ["3"], ["4"], ["5"])]) == managed.SAVES
    assert not list((tmp_path / "work").iterdir())  # the run's directory is removed


def test_load_check_catches_a_wrong_step(tmp_path) -> None:
    """The bitwise check is a real one: a state dict changed after the last save does not match its load."""
    sd, names = managed._state_dicts(1 << 20, __import__("torch").bfloat16, 2)
    doc = managed._series(sd, names, str(tmp_path), keep_plain=False)
    assert doc["correct"]
    managed._change(sd, names, 99)  # the state dict moves on; the stored step does not
    targets = {k: v.clone().zero_() for k, v in sd.items()}
    import mmapckpt

    mmapckpt.CheckpointManager(str(tmp_path / "managed")).load(targets)
    assert not managed._same_bits(sd, targets)
