"""`mmapckpt demo` at a tiny size: every phase with its ranges and a verdict, cleaned up (no timing is asserted)."""

from __future__ import annotations

import os

import pytest

from mmapckpt.bench.demo import PHASES, verdict
from mmapckpt.bench.system import cached_fraction, evict, machine_info, warm_up
from mmapckpt.tools.cli import main


def _demo(capsys, d, *extra: str) -> tuple[int, str]:
    code = main(["demo", "--size", "2MB", "--repeats", "2", "--dir", str(d), *extra])
    return code, capsys.readouterr().out


def test_demo_shows_every_phase_with_ranges_and_verdicts(tmp_path, capsys) -> None:
    code, out = _demo(capsys, tmp_path)
    assert code == 0, out
    lines = out.splitlines()
    assert lines[0].startswith("state dict: ") and "2 repetitions" in lines[0]
    cold = machine_info(str(tmp_path))["filesystem"] != "tmpfs"
    for phase, label in PHASES.items():
        if phase == "cold" and not cold:
            continue
        row = next(line for line in lines if line.startswith(label + " "))
        assert row.count(" s (") == 2 and row.rstrip().endswith(")") and "x (" in row, row
        said = next(line for line in lines if line.startswith(label + ": mmapckpt is "))
        assert "middle half of the speed-ups" in said
    assert "bitwise equal to the original: yes" in out
    assert os.listdir(tmp_path) == []  # its temporary checkpoints are gone


@pytest.mark.skipif(not os.path.isdir("/dev/shm") or machine_info("/dev/shm")["filesystem"] != "tmpfs",
                    reason="needs a tmpfs at /dev/shm")
def test_demo_says_when_the_page_cache_cannot_be_dropped(capsys) -> None:
    import tempfile

    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        code, out = _demo(capsys, d, "--repeats", "1")
        assert code == 0, out
        assert "cold load: not shown: the page cache could not be dropped" in out
        assert not any(line.startswith(PHASES["cold"]) for line in out.splitlines())
        assert os.listdir(d) == []


def test_bad_repeats_exit_2(tmp_path, capsys) -> None:
    assert main(["demo", "--repeats", "0", "--dir", str(tmp_path)]) == 2
    assert "--repeats must be at least 1" in capsys.readouterr().err


def test_verdict_needs_the_middle_half_on_one_side() -> None:
    assert verdict([2.0, 1.8, 2.2]) == "faster"
    assert verdict([0.5, 0.6, 0.4]) == "slower"
    assert verdict([0.8, 1.0, 1.3, 1.0]) == "about the same"
    assert verdict([1.5, 1.6, 1.4, 1.5, 1.5, 0.2, 1.5]) == "faster"  # one disturbed repetition does not flip it
    assert verdict([1.02, 1.03, 1.01]) == "about the same"  # within the margin
    assert verdict([3.0]) == "faster"


def test_cached_fraction_tells_warm_from_evicted(tmp_path) -> None:
    p = str(tmp_path / "f.bin")
    with open(p, "wb") as f:
        f.write(os.urandom(1 << 20))
    warm_up([p])
    assert cached_fraction([p]) == 1.0
    evict([p])
    left = cached_fraction([p])
    if machine_info(str(tmp_path))["filesystem"] == "tmpfs":
        assert left == 1.0  # a tmpfs keeps its pages: the demo then shows no cold row
    else:
        assert left is not None and left < 0.5
    assert cached_fraction([]) is None
