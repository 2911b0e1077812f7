"""Saves to an object store killed at any moment and restarted at once, and concurrent saves, on the real radosgw.

A child process overwrites one ``s3://`` checkpoint again and again (two versions in turn,
several multipart parts each) and is SIGKILLed a seeded random delay after it is ready, twelve
times; the next child is the restarted job, whose first save must take the killed one's lock over
at once (``lock_wait=0``: it never waits for the 30 s lease). After every kill the checkpoint
loads bitwise as one of the two versions (never a mix, never an error once one save has
committed); the uploads and objects a killed save left are gone after the next save completes:
only ``.metadata`` and the shard it references remain, and no multipart upload is in progress.
A second save while a live one holds the location's lock waits ``lock_wait`` and is refused;
a lock whose save died on another machine is taken over after *its* lease.
"""

from __future__ import annotations

import json
import os
import random
import select
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from s3_data import SMALL_PARTS, assert_same, state_dict

import mmapckpt
from mmapckpt import CheckpointWriteError

#: Saves keep the default lease (30 s) and never wait for a lock: a killed save's lock must be taken
#: over at once by the restarted job on this machine (its pid is gone), not after its lease.
_OPTIONS = {**SMALL_PARTS, "lock_wait": 0}
_CHILD = textwrap.dedent("""
    import sys, time, warnings
    warnings.filterwarnings("ignore")
    sys.path.insert(0, sys.argv[2])
    import mmapckpt
    from s3_data import SMALL_PARTS, state_dict
    versions = [state_dict(salt=1), state_dict(salt=2)]
    options = {**SMALL_PARTS, "lock_wait": 0}
    mmapckpt.MmapWriter(sys.argv[1], storage_options=options).storage  # boto3 imported, the shared client made
    print("ready", flush=True)  # the parent's clock for the kill starts here, at the first save
    i = 0
    while True:
        mmapckpt.save(versions[i % 2], sys.argv[1], storage_options=options)  # a refused lock: a traceback
        print(i % 2, flush=True)
        i += 1
""")


def _objects(client, bucket: str, prefix: str) -> list[str]:
    return sorted(o["Key"][len(prefix) + 1:]
                  for o in client.list_objects_v2(Bucket=bucket, Prefix=prefix + "/").get("Contents", []))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_save_killed_at_any_moment_leaves_a_whole_checkpoint_and_its_restart_saves_at_once(
        s3_env, s3_bucket, s3_server):
    url = f"s3://{s3_bucket}/ckpt"
    versions = [state_dict(salt=1), state_dict(salt=2)]
    mmapckpt.save(versions[0], url, storage_options=_OPTIONS)
    client = s3_server.client()
    rng = random.Random(1234)
    here = os.path.dirname(__file__)
    left_behind = 0
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID")}
    for trial in range(12):
        child = subprocess.Popen([sys.executable, "-c", _CHILD, url, here], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, env=env)
        try:
            # the kill lands at a seeded moment of the save loop, however long the child took to start
            ready, _, _ = select.select([child.stdout], [], [], 120)
            line = child.stdout.readline() if ready else b""  # type: ignore[union-attr]
            assert line == b"ready\n", "the saving process did not start"
            time.sleep(rng.uniform(0.1, 3.0))
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait(timeout=30)
        out = child.stdout.read().decode()  # type: ignore[union-attr]
        err = child.stderr.read().decode()  # type: ignore[union-attr]
        child.stdout.close()  # type: ignore[union-attr]
        child.stderr.close()  # type: ignore[union-attr]
        assert "Traceback" not in err, err
        got = mmapckpt.load(url)
        match = [i for i, v in enumerate(versions)
                 if all(torch.equal(got[n].view(torch.uint8), v[n].view(torch.uint8)) if v[n].numel() else True
                        for n in v)]
        assert match, f"trial {trial}: the checkpoint is neither version ({out.split()[-3:]} saved)"
        uploads = client.list_multipart_uploads(Bucket=s3_bucket).get("Uploads", [])
        left_behind += len(uploads) + len(_objects(client, s3_bucket, "ckpt")) - 2  # the lock object too
    # every trial's child was killed mid-way through some save at least once in all (a count, not a timing)
    assert left_behind > 0, "no kill caught a save in progress: the trial timing no longer covers a save"
    mmapckpt.save(versions[1], url, storage_options=_OPTIONS)  # at once: the last killed save's lock is taken over
    objects = _objects(client, s3_bucket, "ckpt")
    assert len(objects) == 2 and ".metadata" in objects, objects
    assert not client.list_multipart_uploads(Bucket=s3_bucket).get("Uploads")
    assert_same(mmapckpt.load(url), versions[1])


def test_a_second_save_is_refused_while_one_holds_the_lock(s3_env, s3_bucket, s3_server):
    url = f"s3://{s3_bucket}/locked"
    storage = mmapckpt.MmapWriter(url).storage
    held = storage.lock()
    try:
        with pytest.raises(CheckpointWriteError, match="another save or conversion holds this location's lock"):
            mmapckpt.save({"a": torch.ones(3)}, url, storage_options={"lock_wait": 1})
        assert not storage.exists(".metadata")
    finally:
        held.release()
    mmapckpt.save({"a": torch.ones(3)}, url)
    assert _objects(s3_server.client(), s3_bucket, "locked") == [".metadata", "__0_0.distcp"]


def test_a_dead_saves_lock_is_taken_over_after_its_own_lease(s3_env, s3_bucket, s3_server):
    url = f"s3://{s3_bucket}/stale"
    def lock_object(lease):  # as a save on another machine leaves it: present, not renewed since
        body = json.dumps({"owner": "dead", "host": "another-node", "pid": 7, "lease": lease}).encode()
        s3_server.client().put_object(Bucket=s3_bucket, Key="stale/.mmapckpt-lock", Body=body)

    # within its lease (a long one: a loaded machine may take seconds to reach the check) it is respected
    lock_object(600)
    with pytest.raises(CheckpointWriteError, match="holds this location's lock"):
        mmapckpt.save({"a": torch.ones(3)}, url, storage_options={"lock_wait": 0, "lock_lease": 1})
    lock_object(1)
    time.sleep(3.2)  # the store's clock counts whole seconds: older than 1 s + 1 s by it
    # the contender's own (long) lease is not what judges the holder
    mmapckpt.save({"a": torch.ones(3)}, url, storage_options={"lock_lease": 600, "lock_wait": 0})
    assert_same(mmapckpt.load(url), {"a": torch.ones(3)})
    assert _objects(s3_server.client(), s3_bucket, "stale") == [".metadata", "__0_0.distcp"]
