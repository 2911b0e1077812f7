"""Seeded SIGKILL trials: a job saving with retention, killed at random moments and restarted, on both media.

A child process resumes from the latest step (loading it and checking it bitwise), then saves step after step with
``keep_last=2, keep_every=3``, printing each step once ``save`` returned (committed and retained). It is SIGKILLed a
seeded random delay after it is ready: inside a save, a commit, or a retention. After every kill, every step that
retention must keep by the steps ever committed is there and loads bitwise, and the next child resumes. After the
last trial one more save leaves nothing but the kept steps' own files (no leftover, no upload in progress).
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

import helpers
from manage_data import blank, same, state, stored_files, uploads_in_progress

import mmapckpt
from mmapckpt.manage.retention import retained

HERE = os.path.dirname(os.path.abspath(__file__))
NUMEL = 1 << 18  # 1 MiB of float32 per step: a save takes long enough for kills to land inside it
KEEP = (2, 3)
_CHILD = textwrap.dedent("""
    import json, sys, warnings
    warnings.filterwarnings("ignore")
    sys.path.insert(0, sys.argv[1])
    import mmapckpt
    from manage_data import blank, same, state
    numel, (keep_last, keep_every) = int(sys.argv[4]), json.loads(sys.argv[5])
    m = mmapckpt.CheckpointManager(sys.argv[2], keep_last=keep_last, keep_every=keep_every,
                                   storage_options=json.loads(sys.argv[3]))
    step = 1
    if m.latest() is not None:  # resume
        got = blank(numel)
        step = m.load(got) + 1
        assert same(got, state(step - 1, numel)), "the latest step does not load bitwise"
    print("ready", flush=True)
    while True:
        m.save(state(step, numel), step)
        print(step, flush=True)
        step += 1
""")


def _trials(medium, trials: int, delays: tuple[float, float], seed: int) -> None:
    rng = random.Random(seed)
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID")}
    committed: set[int] = set()
    m = mmapckpt.CheckpointManager(medium.root, storage_options=medium.options)  # looks, never retains
    for trial in range(trials):
        child = subprocess.Popen([sys.executable, "-c", _CHILD, HERE, medium.root, json.dumps(medium.options),
                                  str(NUMEL), json.dumps(KEEP)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 env=env, text=True)
        try:
            ready, _, _ = select.select([child.stdout], [], [], 120)
            line = child.stdout.readline() if ready else ""
            assert line == "ready\n", f"trial {trial}: the job did not start: {child.stderr.read() if child.poll() is not None else ''}"
            time.sleep(rng.uniform(*delays))
            child.send_signal(signal.SIGKILL)  # by its pid: it has not been reaped
            child.wait(timeout=60)
            out = child.stdout.read()
        finally:
            helpers.stop_processes([child])  # reaped, pipes closed, also when the trial failed
        committed |= {int(s) for s in out.split()}
        steps = m.steps()
        assert child.returncode == -signal.SIGKILL, f"trial {trial}: the job ended by itself"
        must = retained(committed | set(steps), *KEEP)
        assert must <= set(steps), f"trial {trial}: steps {sorted(must - set(steps))} were lost ({steps})"
        for step in steps:
            got = blank(NUMEL)
            assert m.load(got, step) == step and same(got, state(step, NUMEL)), f"trial {trial}: step {step}"
    last = m.latest()
    assert last is not None and last >= 1
    mmapckpt.CheckpointManager(medium.root, keep_last=KEEP[0], keep_every=KEEP[1],
                               storage_options=medium.options).save(state(last + 1, NUMEL), last + 1)
    steps = m.steps()
    assert steps == sorted(retained(committed | set(steps), *KEEP))
    files = {n for n in stored_files(medium.root, medium.client) if not n.startswith(".leases/")}
    assert files == {".mmapckpt-root"} | {f"step-{s}/{n}" for s in steps for n in (".metadata", "__0_0.distcp")}
    assert not uploads_in_progress(medium.root, medium.client)


def test_sigkill_trials_on_local_disk(tmp_path):
    class Local:
        root, options, client, is_s3 = str(tmp_path / "run"), None, None, False
    _trials(Local, trials=4, delays=(0.05, 1.5), seed=45)


def test_sigkill_trials_on_the_object_store(s3_medium):
    _trials(s3_medium, trials=3, delays=(0.2, 3.0), seed=46)
