"""The bench's targets (issue 33) evaluated on hand-made documents, and the disk's read limits (no timing asserted)."""

from __future__ import annotations

import os

import pytest

from mmapckpt.bench import disk, report, system, targets

_NB = 10**9


def _doc(times: dict[str, dict[str, float]], limits: dict[str, float], *, failed: dict[str, str] | None = None,
         scan: dict | None = None) -> dict:
    """A document as report.document makes it, from one median a row (seconds) and one a limit."""
    peers = [k for k in times if k.split("-")[0] in targets.PEER_FAMILIES]
    doc = report.document(
        run_info={"bytes": _NB}, times={k: {p: [s] for p, s in v.items()} for k, v in times.items()},
        limits={k: [s] for k, s in limits.items()}, memory={}, methods=[k for k in times if k not in peers],
        peers={"run": {k: {"kind": "fill", "direct": True} for k in peers}, "failed": failed or {},
               "order": peers + list(failed or {})}, scan=scan)
    return doc


def _by(doc: dict) -> dict[str, dict]:
    return {t["target"]: t for t in doc["targets"]}


_LIMITS = {"copy": 1.0, "write_direct": 2.0, "cold_read": 1.1, "read_direct_x4": 1.0, "read_buffered_x2": 1.2}


def test_fractions_are_of_the_best_read_limit_and_the_issue_thresholds() -> None:
    doc = _doc({"mmapckpt-api": {"cold": 1.05, "warm": 1.11, "save": 2.0},
                "mmapckpt": {"cold": 1.06, "save": 2.01},
                "mmapckpt-fast": {"warm": 1.0 / 0.89}}, _LIMITS)
    assert doc["limits"]["disk_best"]["of"] == "read_direct_x4"  # the fastest read, not the one-stream one
    t = _by(doc)
    assert t["cold: load_into >= 0.95 of the best disk read"]["met"] is True
    assert t["cold: dcp.load + MmapReader >= 0.95 of the best disk read"]["met"] is False
    assert t["warm: load_into >= 0.9 of copy_ into targets"]["met"] is True
    assert t["warm: dcp.load + FastLoadPlanner >= 0.9 of copy_ into targets"]["met"] is False
    assert t["save: mmapckpt.save >= 1.0 of an O_DIRECT write+fsync"]["met"] is True
    assert t["save: dcp.save + MmapWriter >= 1.0 of an O_DIRECT write+fsync"]["met"] is False
    cold = next(r for r in doc["rows"] if r["method"] == "mmapckpt-api" and r["phase"] == "cold")
    assert cold["fraction_of_limit"] == pytest.approx(1 / 1.05) and cold["fraction_of_single_stream"] == pytest.approx(
        1.1 / 1.05)


def test_ahead_of_a_peer_is_against_its_best_variant_and_the_best_mmapckpt_row() -> None:
    doc = _doc({"mmapckpt-api": {"cold": 1.0, "warm": 2.0}, "mmapckpt": {"cold": 0.8, "warm": 1.0},
                "runai": {"cold": 0.9, "warm": 3.0}, "runai-buffered": {"cold": 1.5, "warm": 0.5},
                "tensorizer": {"cold": 1.2, "warm": 1.5}, "fastsafetensors": {"cold": 2.0, "warm": 2.0}}, _LIMITS)
    t = _by(doc)
    assert t["cold: load_into ahead of runai"]["met"] is False  # runai (O_DIRECT) 0.9 s < 1.0 s
    assert t["cold: load_into ahead of runai"]["against"] == "runai"
    assert t["cold: load_into ahead of runai"]["measured"] == pytest.approx(0.9)
    assert t["cold: load_into ahead of tensorizer"]["met"] is True
    assert t["cold: dcp.load + MmapReader ahead of runai"]["met"] is True
    assert t["cold: mmapckpt's best row (mmapckpt) ahead of runai"]["met"] is True
    warm = t["warm: mmapckpt's best row (mmapckpt) ahead of runai"]  # the buffered variant is runai's best warm
    assert warm["against"] == "runai-buffered" and warm["met"] is False and warm["measured"] == pytest.approx(0.5)
    assert t["warm: mmapckpt's best row (mmapckpt) ahead of fastsafetensors"]["met"] is True
    lines = targets.render(doc["targets"], listed=True)
    assert "  warm: mmapckpt's best row (mmapckpt) ahead of runai: 0.50 (runai-buffered), above 1.0: MISSED" in lines
    one = targets.render(doc["targets"], listed=False)[1]
    assert one.startswith("targets: ") and "warm: mmapckpt's best row (mmapckpt) ahead of runai" in one


def test_unmeasured_targets_say_why_and_are_never_met() -> None:
    doc = _doc({"mmapckpt-api": {"cold": 1.0}, "runai": {"cold": 2.0}}, {"copy": 1.0},
               failed={"tensorizer": "not installed: ModuleNotFoundError: No module named 'tensorizer'"})
    t = _by(doc)
    assert "disk_best" not in doc["limits"]
    assert t["cold: load_into >= 0.95 of the best disk read"]["met"] is None
    assert "not measured" in t["cold: load_into >= 0.95 of the best disk read"]["note"]
    assert t["cold: load_into ahead of tensorizer"]["note"].startswith("tensorizer: not installed")
    assert t["cold: load_into ahead of fastsafetensors"]["note"] == "fastsafetensors was not run (add it to --methods)"
    assert t["warm: dcp.load + FastLoadPlanner >= 0.9 of copy_ into targets"]["note"].startswith("mmapckpt-fast was not")
    assert t["many-entry scan: its targets"]["met"] is None
    assert t["cold: load_into ahead of runai"]["met"] is True
    one = targets.render(doc["targets"], listed=False)[1]
    assert one.startswith("targets: 2 of 2 met, 15 not measured, ")  # load_into and the best row, ahead of runai


def test_the_scan_targets_are_carried_over() -> None:
    scan = {"tensors": 10, "targets": [{"case": "transformer", "tensors": 13, "target": "mmapckpt.save <= save_file",
                                        "ratio": 1.2, "at_most": 1.0, "met": False}], "correct": True}
    t = _by(_doc({"mmapckpt-api": {"save": 1.0}}, {"write_direct": 1.0}, scan=scan))
    s = t["scan, transformer 13 tensors: mmapckpt.save <= save_file"]
    assert s["met"] is False and s["measured"] == 1.2 and s["at_most"] == 1.0


@pytest.mark.parametrize("streams", disk.STREAMS)
def test_parallel_reads_cover_the_file_exactly(tmp_path, streams: int) -> None:
    size = (3 << 20) + 12345  # not a whole number of blocks: the O_DIRECT tail reads short
    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(size))
    pieces = [p for s in disk._ranges([str(path)], streams) for p in s]
    assert sorted((a, b) for _, a, b in pieces if b > a) == sorted(
        set((a, b) for _, a, b in pieces if b > a)) and sum(b - a for _, a, b in pieces) == size
    assert all(a % 4096 == 0 for _, a, b in pieces if b > a)
    for direct in (False, True):
        t = disk.read_streams([str(path)], streams, direct=direct)
        assert t is None if direct and t is None else t > 0  # None only where the file system refuses O_DIRECT


def test_several_files_are_dealt_to_the_streams(tmp_path) -> None:
    paths = []
    for i in range(5):
        p = tmp_path / f"p{i}"
        p.write_bytes(os.urandom(5000 + i))
        paths.append(str(p))
    plan = disk._ranges(paths, 2)
    assert [[x[0] for x in s] for s in plan] == [paths[0::2], paths[1::2]]
    assert disk.read_streams(paths, 2, direct=False) > 0


def test_the_limits_reuse_their_buffers(tmp_path) -> None:
    """A buffer made afresh each call puts its page faults inside the timed read."""
    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(1 << 20))
    assert system.read_buffer() is system.read_buffer() and len(system.read_buffer()) == system.CHUNK
    first = [id(b) for b in disk.buffers_for(4)]
    disk.read_streams([str(path)], 4, direct=False)
    assert [id(b) for b in disk.buffers_for(4)] == first
    assert system.cold_read_limit(str(path)) > 0
