"""A step that a process is loading is not removed under it: leases, on both media."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import textwrap
import time

import helpers
import pytest
from manage_data import blank, same, state

import mmapckpt
from mmapckpt.manage import retention

HERE = os.path.dirname(os.path.abspath(__file__))


def test_a_leased_step_survives_retention_and_goes_once_released(medium):
    m = mmapckpt.CheckpointManager(medium.root, keep_last=1, storage_options=medium.options)
    m.save(state(1), 1)
    with m.lease(1):
        m.save(state(2), 2)
        m.save(state(3), 3)
        assert m.steps() == [1, 3]  # 2 went, 1 is leased
        # a reader that does not go through the manager, holding the lease
        assert same(mmapckpt.load(m.path(1), storage_options=medium.options),
                    {k: v for k, v in state(1).items() if k != "step"})
    m.save(state(4), 4)
    assert m.steps() == [4]


def test_a_reader_that_leased_after_the_first_look_gets_its_step_back(tmp_path, monkeypatch):
    """The race leases.py closes: the lease appears between retention's two looks. The step's .metadata, removed
    first, is put back, and none of its files is removed."""
    m = mmapckpt.CheckpointManager(tmp_path / "run", keep_last=1)
    m.save(state(1), 1)
    looks = iter([set(), {1}])
    monkeypatch.setattr(retention, "live_leases", lambda root, tidy=False: next(looks))
    m.save(state(2), 2)
    assert m.steps() == [1, 2]
    got = blank()
    m.load(got, 1)
    assert same(got, state(1))


def _lease_file(root, step, holder, expires):
    d = os.path.join(root, ".leases")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, f"step-{step}.{'ab' * 8}.lease"), "w") as f:
        json.dump({"step": step, "expires": expires, "lease": 5.0, "holder": holder}, f)


@pytest.mark.parametrize("holder, expires_in, kept", [
    ({"host": "another-node", "pid": 7}, 600, True),  # live, elsewhere: respected
    ({"host": "another-node", "pid": 7}, -11, False),  # past expiry plus one more lease
    ("dead here", 600, False),  # a process of this machine that is gone: at once
], ids=["live-elsewhere", "expired", "dead-here"])
def test_leases_that_no_live_loader_holds_are_ignored(tmp_path, holder, expires_in, kept):
    m = mmapckpt.CheckpointManager(tmp_path / "run", keep_last=1)
    m.save(state(1), 1)
    expires = time.time() + expires_in  # from now, not from the collection (a long run outlived a fixed time)
    if holder == "dead here":
        from mmapckpt.storage.holders import this_process
        child = subprocess.Popen([sys.executable, "-c", "pass"])
        child.wait()
        holder = {**this_process(None, 5.0), "pid": child.pid, "start": None}
    _lease_file(m.root, 1, holder, expires)
    m.save(state(2), 2)
    assert m.steps() == ([1, 2] if kept else [2])
    if not kept:
        assert os.listdir(os.path.join(m.root, ".leases")) == []  # tidied


_READER = textwrap.dedent("""
    import json, os, sys, warnings
    warnings.filterwarnings("ignore")
    sys.path.insert(0, sys.argv[1])
    import mmapckpt
    from manage_data import blank, same, state
    m = mmapckpt.CheckpointManager(sys.argv[2], storage_options=json.loads(sys.argv[3]), lease_seconds=2)
    print("ready", flush=True)
    while not os.path.exists(sys.argv[4]):
        got = blank()
        step = m.load(got)
        print(step if same(got, state(step)) else f"MISMATCH {step}", flush=True)
""")


def test_a_concurrent_reader_never_loses_its_step(medium, tmp_path):
    m = mmapckpt.CheckpointManager(medium.root, keep_last=1, storage_options=medium.options)
    m.save(state(1), 1)
    stop = tmp_path / "stop"
    child = subprocess.Popen([sys.executable, "-c", _READER, HERE, medium.root, json.dumps(medium.options),
                              str(stop)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([child.stdout], [], [], 120)
        assert ready and child.stdout.readline() == "ready\n", child.stderr.read() if child.poll() else ""
        for step in range(2, 6 if medium.is_s3 else 14):
            m.save(state(step), step)
        stop.touch()
        out, err = child.communicate(timeout=120)
    finally:
        helpers.stop_processes([child])
    assert child.returncode == 0, err
    loaded = out.split()
    assert loaded and "MISMATCH" not in out, out
    assert len(set(loaded)) > 1, out  # the loads ran while the saves and their retention did
    m.save(state(100), 100)
    assert m.steps() == [100]  # the leases went with the loads: the next retention caught up


def test_a_load_whose_commit_is_put_back_loads_it(tmp_path, monkeypatch):
    """The other side of the race: the reader checked the commit, then retention (seeing its lease only at its
    second look) removed the .metadata before DCP read it, and puts it back. The load waits for it and loads."""
    import threading

    from mmapckpt.manage import manager as manager_module

    m = mmapckpt.CheckpointManager(tmp_path / "run")
    m.save(state(1), 1)
    meta = os.path.join(m.path(1), ".metadata")
    data = open(meta, "rb").read()
    calls = []

    class Raced(mmapckpt.MmapReader):
        def read_metadata(self, *args, **kwargs):
            if not calls:
                os.unlink(meta)  # retention's first step
                threading.Timer(0.3, lambda: open(meta, "wb").write(data)).start()  # ... and its put-back
            calls.append(1)
            return super().read_metadata(*args, **kwargs)

    monkeypatch.setattr(manager_module, "MmapReader", Raced)
    got = blank()
    assert m.load(got) == 1 and same(got, state(1))
    assert len(calls) >= 2
