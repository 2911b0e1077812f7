"""A restarted job: what a killed save left is cleared, the same step saves again at once, training resumes."""

from __future__ import annotations

import json
import os

from manage_data import blank, same, state, stored_files, uploads_in_progress

import mmapckpt
from mmapckpt.manage.retention import clear_step
from mmapckpt.manage.root import Root


def _leave_a_killed_save(medium, step):
    """What a save of ``step`` killed mid-way leaves: a shard without .metadata, a temporary file or an upload in
    progress, and on the object store its lock object, as a holder on another machine leaves it (leased for 10 min,
    so the lock's own rules would make a save wait for it)."""
    if not medium.is_s3:
        d = os.path.join(medium.root, f"step-{step}")
        os.makedirs(d)
        for name in ("__0_0.distcp", ".__0_0.distcp.tmp-0123456789ab"):
            with open(os.path.join(d, name), "wb") as f:
                f.write(b"half a shard")
        return
    bucket, _, prefix = medium.root[5:].partition("/")
    key = f"{prefix}/step-{step}"
    c = medium.client
    c.put_object(Bucket=bucket, Key=f"{key}/__0_0.distcp", Body=b"half a shard")
    c.create_multipart_upload(Bucket=bucket, Key=f"{key}/__0_1.distcp")
    lock = {"owner": "dead", "host": "another-node", "pid": 7, "lease": 600}
    c.put_object(Bucket=bucket, Key=f"{key}/.mmapckpt-lock", Body=json.dumps(lock).encode())


def test_a_killed_saves_leftovers_are_cleared_and_the_step_saves_again_at_once(medium):
    options = None if medium.options is None else {**medium.options, "lock_wait": 0}  # never wait for a lock
    m = mmapckpt.CheckpointManager(medium.root, keep_last=2, storage_options=options)
    m.save(state(1), 1)
    m.save(state(2), 2)
    _leave_a_killed_save(medium, 3)
    assert m.steps() == [1, 2]  # step 3 is no step: no .metadata
    # the restarted job: a new manager, resumes from the latest step, saves step 3 again
    m = mmapckpt.CheckpointManager(medium.root, keep_last=2, storage_options=options)
    got = blank()
    assert m.load(got) == 2 and same(got, state(2))
    m.save(state(3), 3)
    assert m.steps() == [2, 3]
    files = stored_files(medium.root, medium.client)
    assert sorted(n for n in files if n.startswith("step-3/")) == ["step-3/.metadata", "step-3/__0_0.distcp"]
    assert not uploads_in_progress(medium.root, medium.client)
    got = blank()
    assert m.load(got) == 3 and same(got, state(3))


def test_leftovers_below_the_latest_step_go_at_the_next_retention(tmp_path):
    class Local:
        root, is_s3 = str(tmp_path / "run"), False
    m = mmapckpt.CheckpointManager(Local.root, keep_last=5)
    m.save(state(1), 1)
    m.save(state(3), 3)
    _leave_a_killed_save(Local, 2)  # e.g. a retention killed after it removed step 2's .metadata
    m.save(state(4), 4)
    assert sorted(os.listdir(Local.root)) == [".mmapckpt-root", "step-1", "step-3", "step-4"]


def test_files_other_steps_name_are_never_cleared(tmp_path):
    """A step's files that another retained step refers to (unchanged chunks stored once, docs/format.md) stay."""
    m = mmapckpt.CheckpointManager(tmp_path / "run")
    m.save(state(1), 1)
    root = Root(m.root)
    assert clear_step(root, 1, {"step-1/__0_0.distcp"}) == ["__0_0.distcp"]
    assert os.listdir(m.path(1)) == ["__0_0.distcp"]  # .metadata went first; the referenced shard stayed
    assert clear_step(root, 1, set()) == [] and not os.path.exists(m.path(1))


def test_an_upload_alone_below_the_latest_step_goes_at_the_next_retention(s3_medium):
    m = mmapckpt.CheckpointManager(s3_medium.root, keep_last=5, storage_options=s3_medium.options)
    m.save(state(1), 1)
    m.save(state(3), 3)
    bucket, _, prefix = s3_medium.root[5:].partition("/")
    s3_medium.client.create_multipart_upload(Bucket=bucket, Key=f"{prefix}/step-2/__0_0.distcp")  # nothing else
    m.save(state(4), 4)
    assert not uploads_in_progress(s3_medium.root, s3_medium.client)
    assert m.steps() == [1, 3, 4]
