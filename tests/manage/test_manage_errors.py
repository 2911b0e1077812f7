"""What a manager refuses, and how it says so: bad roots, missing steps, overwrites, bad arguments."""

from __future__ import annotations

import json
import os

import pytest
from manage_data import blank, state

import mmapckpt
from mmapckpt import CheckpointError, CheckpointExistsError, CheckpointNotFoundError


def test_a_file_is_no_root(tmp_path):
    (tmp_path / "f").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="must be a directory") as e:
        mmapckpt.CheckpointManager(tmp_path / "f")
    assert e.value.path == str(tmp_path / "f")


def test_a_checkpoint_is_no_root(tmp_path):
    mmapckpt.save({"a": state(1)["model.w"]}, tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match="this is a checkpoint, not a root"):
        mmapckpt.CheckpointManager(tmp_path / "ckpt")


@pytest.mark.parametrize("marker, error, match", [
    (b"garbage", mmapckpt.FormatError, "not a root marker"),
    (json.dumps({"format": "mmapckpt-root", "version": 9}).encode(), mmapckpt.UnsupportedVersionError,
     "root layout version 9"),
])
def test_a_foreign_marker_is_refused(tmp_path, marker, error, match):
    (tmp_path / ".mmapckpt-root").write_bytes(marker)
    with pytest.raises(error, match=match) as e:
        mmapckpt.CheckpointManager(tmp_path)
    assert e.value.path == str(tmp_path / ".mmapckpt-root")


def test_a_url_of_no_medium_is_refused():
    with pytest.raises(CheckpointError, match="no storage serves"):
        mmapckpt.CheckpointManager("nosuch://bucket/run")


def test_missing_steps_raise_not_found_naming_them(medium):
    m = mmapckpt.CheckpointManager(medium.root, storage_options=medium.options)
    with pytest.raises(CheckpointNotFoundError, match="no committed step under this root yet"):
        m.load(blank())
    m.save(state(1), 1)
    m.save(state(3), 3)
    with pytest.raises(CheckpointNotFoundError, match=r"no committed step 2 under this root \(committed: 1, 3\)") as e:
        m.load(blank(), 2)
    assert e.value.path == m.path(2)
    assert not any(n.startswith("step-2") for n in os.listdir(medium.root)) if not medium.is_s3 else True


def test_a_committed_step_is_never_overwritten(medium):
    m = mmapckpt.CheckpointManager(medium.root, storage_options=medium.options)
    m.save(state(1), 1)
    with pytest.raises(CheckpointExistsError, match="step 1 is already committed"):
        m.save(state(2), 1)
    got = blank()
    m.load(got, 1)
    assert got["step"] == 1


@pytest.mark.parametrize("kwargs", [{"keep_last": 0}, {"keep_every": -1}, {"keep_last": 1.5}, {"keep_last": True},
                                    {"lease_seconds": 0}])
def test_bad_arguments(tmp_path, kwargs):
    with pytest.raises(ValueError):
        mmapckpt.CheckpointManager(tmp_path, **kwargs)


def test_bad_steps(tmp_path):
    m = mmapckpt.CheckpointManager(tmp_path)
    for step in (-1, "3", 2.0, None):
        with pytest.raises(ValueError, match="a step is an int >= 0"):
            m.save(state(1), step)
    with pytest.raises(TypeError, match="async_=True"):
        m.save(state(1), 1, stager=object())
    assert m.steps() == [] and not os.path.exists(tmp_path / ".mmapckpt-root")


def test_a_reader_does_not_create_the_root(tmp_path):
    m = mmapckpt.CheckpointManager(tmp_path / "run")
    assert m.steps() == [] and m.latest() is None and not os.path.exists(tmp_path / "run")
    m.save(state(0), 0)
    assert json.loads((tmp_path / "run" / ".mmapckpt-root").read_text()) == {"format": "mmapckpt-root", "version": 1}
    assert m.steps() == [0] and m.path(0) == str(tmp_path / "run" / "step-0")
