"""``mmapckpt inspect ROOT``: the steps of a managed root with their sizes; a step is inspected as any checkpoint."""

from __future__ import annotations

import json
import os

from manage_data import state, stored_files

import mmapckpt
from mmapckpt.manage.describe import describe_root
from mmapckpt.tools.cli import main


def test_describe_root_lists_steps_with_their_sizes(medium):
    m = mmapckpt.CheckpointManager(medium.root, keep_last=2, storage_options=medium.options)
    for step in (1, 2, 3):
        m.save(state(step), step)
    info = describe_root(medium.root, storage_options=medium.options)
    files = stored_files(medium.root, medium.client)
    assert [s.step for s in info.steps] == [2, 3] and all(s.committed for s in info.steps)
    for s in info.steps:
        own = {n: v for n, v in files.items() if n.startswith(f"step-{s.step}/")}
        assert (s.files, s.bytes, s.own_bytes, s.shared_bytes) == (2, sum(own.values()), sum(own.values()), 0)
    assert info.stored_bytes == sum(v for n, v in files.items() if n.startswith("step-"))
    assert describe_root(m.path(3), storage_options=medium.options) is None  # a step is no root


def test_inspect_command_on_a_root(tmp_path, capsys):
    root = str(tmp_path / "run")
    m = mmapckpt.CheckpointManager(root)
    m.save(state(10), 10)
    m.save(state(20), 20)
    os.makedirs(os.path.join(root, "step-30"))  # a save killed before its first file
    assert main(["inspect", root]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0] == f"{root}: managed root, 2 steps (latest 20)"
    assert lines[2].split() == ["step", "files", "bytes", "own", "shared"]
    assert lines[3].split()[:2] == ["10", "2"] and lines[4].split()[:2] == ["20", "2"]
    assert "incomplete (no .metadata)" in lines[5] and lines[5].split()[0] == "30"
    assert main(["inspect", root, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [s["step"] for s in doc["steps"]] == [10, 20, 30] and doc["totals"]["steps"] == 2
    assert main(["inspect", m.path(20)]) == 0  # one step: an ordinary checkpoint
    assert "model.w" in capsys.readouterr().out
