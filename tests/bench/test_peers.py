"""The peer loaders in `mmapckpt bench`: their rows, their bitwise checks, and a peer that cannot run (no timing is
asserted)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest
import torch

from mmapckpt.bench import runner as bench
from mmapckpt.bench.peers import PEER_KEYS, PEERS, PeerRun, family
from mmapckpt.bench.report import row_prefix
from mmapckpt.bench.synthetic import transformer_state_dict

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _args(tmp_path, *extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args(["--quick", "--size", "2MB", "--tensors", "13", "--out", str(tmp_path / "out"),
                              "--dir", str(tmp_path / "work"), "--threads", "1", "--no-memory", *extra])


def test_every_peer_has_warm_and_cold_rows_checked_bitwise(tmp_path, capsys) -> None:
    assert bench.run(_args(tmp_path, "--methods", "mmapckpt-api," + ",".join(PEER_KEYS), "--targets")) == 0
    out = capsys.readouterr().out
    doc = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert doc["peers"]["failed"] == {}, doc["peers"]["failed"]
    got = {(r["method"], r["phase"]) for r in doc["rows"] if r.get("peer")}
    assert got == {(k, p) for k in PEER_KEYS for p in ("warm", "cold")}
    assert doc["run"]["correct"] == {k: True for k in ("mmapckpt-api", *PEER_KEYS)}

    info = doc["peers"]["run"]
    kinds = {"tensorizer": "new", "runai": "fill", "fastsafetensors": "views"}
    for p in PEERS:
        i = info[p.key]
        assert i["kind"] == kinds[family(p.key)] and i["direct"] == p.direct and i["settings"] == p.settings
        assert i["reads"] == (["model.tensors"] if p.key == "tensorizer" else ["model.safetensors"])
        assert i["version"] and i["version"] != "unknown"
        assert f"  {p.key}: {p.label} ({i['version']}): {p.settings}" in out
    assert info["runai"]["strategy"] in ("io_uring_direct", "libaio_direct", "sync_buffered")
    assert info["runai-buffered"]["strategy"] == "sync_buffered"
    assert isinstance(info["tensorizer"]["num_readers"], int)
    for r in doc["rows"]:
        if r.get("peer"):
            assert r["returns"] == kinds[family(r["method"])] and r["direct"] == info[r["method"]]["direct"]
            line = next(x for x in out.splitlines() if x.startswith(row_prefix(r["phase"], r["method"])))
            assert line.endswith("O_DIRECT" if r["direct"] else "buffered") and f" {r['returns']} " in line
        elif r["phase"] in ("warm", "cold"):
            assert r["returns"] == "fill" and r["direct"] is False
    # the cold rows are held to the best of the read limits
    best = doc["limits"]["disk_best"]
    assert best["median_s"] == min(v["median_s"] for k, v in doc["limits"].items() if k.startswith(("read_", "cold")))
    for r in doc["rows"]:
        if r["phase"] == "cold":
            assert r["fraction_of_limit"] == best["median_s"] / r["median_s"]
    # each peer loader is measured against mmapckpt's rows
    ahead = [t for t in doc["targets"] if " ahead of " in t["target"]]
    assert {t["target"].rsplit(" ", 1)[1] for t in ahead} == {"tensorizer", "runai", "fastsafetensors"}
    assert all(t["met"] is not None for t in ahead if t["method"] == "mmapckpt-api")
    assert not [n for n in os.listdir(tmp_path / "work") if n.startswith(".mmapckpt-bench-")]


@pytest.fixture()
def peer_run(tmp_path):
    sd = transformer_state_dict(1 << 20, layers=1)
    run = PeerRun([p for p in PEERS if p.key in ("runai-buffered", "fastsafetensors-buffered")],
                  str(tmp_path / "peers"), threads=1)
    try:
        run.prepare(sd)
        yield run, sd
    finally:
        run.close()


def _corrupt_tensor(path: str, name: str) -> None:
    """Flip one byte of the tensor's data in a safetensors file."""
    with open(path, "r+b") as f:
        n = int.from_bytes(f.read(8), "little")
        begin = json.loads(f.read(n))[name]["data_offsets"][0]
        f.seek(8 + n + begin)
        b = f.read(1)
        f.seek(8 + n + begin)
        f.write(bytes([b[0] ^ 0x40]))


def test_a_peer_that_loads_wrong_bytes_fails_its_check(peer_run) -> None:
    run, sd = peer_run
    for key in run.active():
        assert run.load(key, check=True)[1] is True
    name = "layers.0.mlp.up.weight"
    _corrupt_tensor(os.path.join(run.dir, "model.safetensors"), name)
    for key in run.active():
        seconds, ok = run.load(key, check=True)
        assert seconds > 0 and ok is False and run.info[key]["mismatch"] == [name]


def test_a_peer_that_fails_to_run_says_why_and_stops(peer_run) -> None:
    run, _ = peer_run
    os.unlink(os.path.join(run.dir, "model.safetensors"))
    for key in list(run.active()):
        proc = run.workers[key].proc
        assert run.load(key, check=False) is None
        assert run.failed[key].startswith("failed: ") and "\n" not in run.failed[key]
        assert key not in run.active() and proc.poll() is not None


def test_a_peer_that_does_not_import_is_reported_and_the_run_goes_on(tmp_path) -> None:
    """tensorizer hidden from its process (None in sys.modules, as an uninstalled module would fail): the bench says
    why in one line, leaves its targets unmeasured with that reason, and measures the rest."""
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text("import sys\nsys.modules['tensorizer'] = None\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(hide), _ROOT])}
    proc = subprocess.run([sys.executable, "-m", "mmapckpt", "bench", "--quick", "--size", "1MB", "--tensors", "13",
                           "--methods", "mmapckpt-api,tensorizer,fastsafetensors-buffered", "--no-memory", "--targets",
                           "--threads", "1", "--dir", str(tmp_path / "work"), "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=300, env=env, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads((tmp_path / "out" / "bench.json").read_text())
    why = doc["peers"]["failed"]["tensorizer"]
    assert why.startswith(("not installed: ImportError", "not installed: ModuleNotFoundError")) and "tensorizer" in why
    assert f"  tensorizer: skipped: {why}" in proc.stdout
    assert {r["method"] for r in doc["rows"] if r.get("peer")} == {"fastsafetensors-buffered"}
    assert doc["run"]["correct"] == {"mmapckpt-api": True, "fastsafetensors-buffered": True}
    t = next(t for t in doc["targets"] if t["target"] == "cold: load_into ahead of tensorizer")
    assert t["met"] is None and t["note"] == f"tensorizer: {why}"
    assert f"cold: load_into ahead of tensorizer: not measured (tensorizer: {why})" in proc.stdout


def test_the_bench_process_imports_no_peer(tmp_path) -> None:
    code = ("import sys; from mmapckpt.bench import runner; "
            "runner.main(['--quick', '--size', '1MB', '--tensors', '13', '--methods', 'mmapckpt-api,runai-buffered', "
            f"'--no-memory', '--threads', '1', '--dir', {str(tmp_path)!r}]); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('tensorizer', 'runai_model_streamer', 'fastsafetensors')))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": _ROOT})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]"
    assert "runai-buffered" in proc.stdout and torch.__version__


def test_a_peer_that_hangs_is_killed_and_reported(peer_run, monkeypatch) -> None:
    import signal

    from mmapckpt.bench import peers

    run, _ = peer_run
    monkeypatch.setattr(peers, "_ANSWER_TIMEOUT_S", 2)
    key = run.active()[0]
    proc = run.workers[key].proc
    os.kill(proc.pid, signal.SIGSTOP)  # a real hang: the process cannot answer
    assert run.load(key, check=False) is None
    assert run.failed[key].startswith("failed: no answer in 2 s (killed)")
    assert proc.poll() is not None and key not in run.active()
    assert run.load(run.active()[0], check=True)[1] is True  # the other peer goes on
