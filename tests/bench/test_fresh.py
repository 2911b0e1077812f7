"""`mmapckpt bench --fresh`: every row, its JSON fields and its bitwise check; a wrong load is caught in the
child; the order of the methods changes between repetitions (no timing is asserted)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from mmapckpt.bench.peers import PEER_KEYS
from mmapckpt.bench.fresh import MANY_ROWS, _child, _env, _order, _write

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_PEER_MODULES = {"tensorizer": "tensorizer", "runai": "runai_model_streamer", "fastsafetensors": "fastsafetensors"}


def _installed(key: str) -> bool:
    module = _PEER_MODULES.get(key.split("-", 1)[0])
    if module is None:
        return True
    import importlib.util

    return importlib.util.find_spec(module) is not None


def _stats_ok(s: dict) -> bool:
    return s["n"] == 1 and all(isinstance(s[k], float) and math.isfinite(s[k]) and s[k] > 0
                               for k in ("median_s", "min_s", "max_s"))


@pytest.mark.slow  # about 30 new processes, each importing torch: minutes on a busy 2-core machine
def test_fresh_quick_cli_gives_every_row_checked_bitwise(tmp_path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(x for x in (_ROOT, os.environ.get("PYTHONPATH")) if x),
           "MMAPCKPT_READ_CHOICE": str(tmp_path / "read-choice.json")}  # not the user's cache directory
    out = tmp_path / "out"
    # mmapckpt's own rows and one peer: each row is two new processes, so every peer would cost CI a minute
    # (the peers' loaders are checked bitwise in-process by tests/bench/test_peers.py)
    methods = ["load_into", "dcp_load", "load", "load_model", "safetensors_load_file"]
    proc = subprocess.run([sys.executable, "-m", "mmapckpt", "bench", "--fresh", "--quick", "--threads", "1",
                           "--methods", ",".join(methods), "--out", str(out), "--dir", str(tmp_path / "work")],
                          capture_output=True, text=True, env=env, timeout=1800, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads((out / "bench_fresh.json").read_text())

    assert doc["ok"] is True and doc["failed"] == {}
    run = doc["run"]
    assert run["repeats"] == 1 and 30e6 <= run["bytes"] <= 34e6 and run["open_entries"] == 1000
    assert len(run["load_average_before"]) == 3 and len(run["load_average_after"]) == 3
    assert [r["method"] for r in doc["rows"]] == ["read"] + methods
    assert doc["skipped"] == {} or set(doc["skipped"]) == set()
    for r in doc["rows"]:
        assert r["bitwise"] is True, r
        assert _stats_ok(r["first"]) and _stats_ok(r["second"]), r
        assert _stats_ok(r["first_cpu"]) and _stats_ok(r["second_cpu"]), r  # the child's CPU beside its wall time
        assert r["first_of_limit"] == doc["rows"][0]["first"]["median_s"] / r["first"]["median_s"]
        assert r["second_of_limit"] == doc["rows"][0]["second"]["median_s"] / r["second"]["median_s"]
        assert 0.0 <= r["cached_after_first"] <= 1.0
        assert r["returns"] in ("fill", "views", "new") and r["peer"] == (r["method"] in PEER_KEYS)
    assert [r["method"] for r in doc["many"]] == list(MANY_ROWS)
    for r in doc["many"]:
        assert r["bitwise"] is True and _stats_ok(r["first"]) and _stats_ok(r["second"]), r
        assert _stats_ok(r["first_cpu"]) and _stats_ok(r["second_cpu"]), r
    assert {k: {p: len(v) for p, v in t.items()} for k, t in doc["raw_cpu_times"].items()} == \
        {k: {p: len(v) for p, v in t.items()} for k, t in doc["raw_times"].items()}  # per repetition, both
    # and the system part of each repetition's CPU seconds (getrusage's microseconds beside process_time's clock)
    assert {k: {p: len(v) for p, v in t.items()} for k, t in doc["raw_sys_times"].items()} == \
        {k: {p: len(v) for p, v in t.items()} for k, t in doc["raw_times"].items()}
    for k, t in doc["raw_sys_times"].items():
        for p, v in t.items():
            assert all(0 <= s <= c + 0.01 for s, c in zip(v, doc["raw_cpu_times"][k][p])), (k, p)
    by = {r["method"]: r for r in doc["many"]}
    assert by["open_keys"]["first_vs_safetensors"] == (by["safetensors_keys"]["first"]["median_s"]
                                                       / by["open_keys"]["first"]["median_s"])
    assert "second_vs_safetensors" in by["inspect"]
    # the table says the same, and nothing of the run is left behind
    for r in doc["rows"]:
        assert any(line.startswith(r["label"][:51]) and line.rstrip().endswith(" ok") for line in proc.stdout.splitlines())
    assert "load average" in proc.stdout
    assert not os.listdir(tmp_path / "work")


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("fresh") / "load")
    sd = {"a.weight": torch.arange(3000, dtype=torch.float32).reshape(30, 100), "b": torch.ones(7, dtype=torch.bfloat16)}
    _write(d, sd, {"model.safetensors"})
    return d


def test_a_load_is_checked_bit_for_bit_in_its_child(work) -> None:
    env = _env(1, None)
    got = _child("load_into", work, env)
    assert got["ok"] is True
    assert 0 < got["cpu_s"] and 0 < got["s"]  # the child's CPU seconds (process_time) beside its wall seconds
    assert 0 <= got["sys_s"] <= got["cpu_s"] + 0.01  # and their system part (getrusage)
    with open(os.path.join(work, "spec.json")) as f:
        spec = json.load(f)
    spec["tensors"]["b"][2] = "0" * 32  # the saved state dict said other bytes
    bad = os.path.join(os.path.dirname(work), "tampered")
    os.makedirs(bad, exist_ok=True)
    for name in ("ckpt", "model.safetensors"):
        os.symlink(os.path.join(work, name), os.path.join(bad, name))
    with open(os.path.join(bad, "spec.json"), "w") as f:
        json.dump(spec, f)
    for key in ("load_into", "load", "safetensors_safe_open"):
        got = _child(key, bad, env)
        assert got["ok"] is False and got["bad"] == ["b"], (key, got)
    spec["files_digest"] = "0" * 32
    with open(os.path.join(bad, "spec.json"), "w") as f:
        json.dump(spec, f)
    assert _child("read", bad, env)["ok"] is False


def test_a_child_that_fails_says_why(work) -> None:
    got = _child("load_into", os.path.join(work, "no-such-dir"), _env(1, None))
    assert got["error"].startswith("failed:") and "spec.json" in got["error"]


def test_no_method_always_follows_the_same_one() -> None:
    items = list("ABCDE")
    orders = [_order(items, r) for r in range(3)]
    assert all(sorted(o) == items for o in orders)
    for x in items:
        before = {o[o.index(x) - 1] if o.index(x) else None for o in orders}
        assert len(before) > 1, (x, orders)
    assert len({o[0] for o in orders}) == 3


def test_unknown_fresh_method_is_a_usage_error(tmp_path, capsys) -> None:
    from mmapckpt.tools.cli import main

    assert main(["bench", "--fresh", "--methods", "load_into,nope", "--dir", str(tmp_path)]) == 2
    assert "unknown method(s) nope" in capsys.readouterr().err


def test_a_peer_that_does_not_import_is_skipped_and_the_run_goes_on(tmp_path) -> None:
    """tensorizer hidden from every process (None in sys.modules, as an uninstalled module fails): --fresh says why
    in one line and measures the rest."""
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text("import sys\nsys.modules['tensorizer'] = None\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(hide), _ROOT]),
           "MMAPCKPT_READ_CHOICE": str(tmp_path / "read-choice.json")}
    proc = subprocess.run([sys.executable, "-m", "mmapckpt", "bench", "--fresh", "--quick", "--size", "2MB",
                           "--methods", "load_into,tensorizer", "--open-entries", "0", "--threads", "1",
                           "--dir", str(tmp_path / "work"), "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=600, env=env, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads((tmp_path / "out" / "bench_fresh.json").read_text())
    why = doc["skipped"]["tensorizer"]
    assert why.startswith("not installed: ") and "tensorizer" in why and "\n" not in why
    assert f"skipped tensorizer: {why}" in proc.stdout
    assert [r["method"] for r in doc["rows"]] == ["read", "load_into"] and doc["many"] == []
    assert doc["ok"] is True and all(r["bitwise"] for r in doc["rows"])
