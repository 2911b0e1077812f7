"""Saves to ``az://`` killed at seeded moments and restarted at once (as tests/s3/test_s3_crash_and_lock.py on S3).

A child overwrites one checkpoint again and again (two versions in turn, several blocks each) and is
SIGKILLed a seeded random delay after it is ready, five times; the next child is the restarted job,
whose first save must break the killed one's lease at once (``lock_wait=0``; the lease would last
up to 30 s). After every kill the checkpoint loads bitwise as one of the two versions; after the
last save only ``.metadata`` and its shard remain (uncommitted blocks are no blobs).
"""

from __future__ import annotations

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
from s3_data import assert_same, state_dict

import mmapckpt

_OPTIONS = {"part_size": 1 << 20, "upload_part_size": 2 << 20, "lock_wait": 0}
_CHILD = textwrap.dedent("""
    import sys, warnings
    warnings.filterwarnings("ignore")
    sys.path.insert(0, sys.argv[2])
    import mmapckpt
    from s3_data import state_dict
    versions = [state_dict(salt=1), state_dict(salt=2)]
    options = {"part_size": 1 << 20, "upload_part_size": 2 << 20, "lock_wait": 0}
    mmapckpt.MmapWriter(sys.argv[1], storage_options=options).storage
    print("ready", flush=True)
    i = 0
    while True:
        mmapckpt.save(versions[i % 2], sys.argv[1], storage_options=options)
        print(i % 2, flush=True)
        i += 1
""")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_save_killed_at_any_moment_leaves_a_whole_checkpoint_and_its_restart_saves_at_once(
        az_env, az_container, azurite):
    url = f"az://{az_container}/ckpt"
    versions = [state_dict(salt=1), state_dict(salt=2)]
    mmapckpt.save(versions[0], url, storage_options=_OPTIONS)
    rng = random.Random(46)
    here = os.path.join(os.path.dirname(os.path.dirname(__file__)), "s3")
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID")}
    saved = 0
    for trial in range(5):
        child = subprocess.Popen([sys.executable, "-c", _CHILD, url, here], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, env=env)
        try:
            ready, _, _ = select.select([child.stdout], [], [], 120)
            line = child.stdout.readline() if ready else b""  # type: ignore[union-attr]
            assert line == b"ready\n", "the saving process did not start"
            time.sleep(rng.uniform(0.5, 4.0))
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait(timeout=30)
        out = child.stdout.read().decode()  # type: ignore[union-attr]
        err = child.stderr.read().decode()  # type: ignore[union-attr]
        child.stdout.close()  # type: ignore[union-attr]
        child.stderr.close()  # type: ignore[union-attr]
        assert "Traceback" not in err, err
        saved += len(out.split())
        got = mmapckpt.load(url)
        match = [i for i, v in enumerate(versions)
                 if all(torch.equal(got[n].view(torch.uint8), v[n].view(torch.uint8)) if v[n].numel() else True
                        for n in v)]
        assert match, f"trial {trial}: the checkpoint is neither version"
    assert saved > 0, "no child finished a save: the kills no longer cover whole saves"
    mmapckpt.save(versions[1], url, storage_options=_OPTIONS)  # at once: the last killed save's lease is broken
    names = sorted(b.name for b in azurite.service().get_container_client(az_container).list_blobs())
    assert len(names) == 2 and "ckpt/.metadata" in names, names
    assert_same(mmapckpt.load(url), versions[1])
