"""S3 saves fenced by their lock, on the real radosgw: a save that lost its lock never commits over another's.

- Seeded SIGSTOP/SIGCONT trials of real child processes: a save stops itself just before its
  commit (before the lock check, or between the check and the conditional PUT) for longer than
  its 2 s lease; a second save (its own lease 30 s) takes the lock over and either commits before the first resumes,
  or stops itself before its own commit and resumes after it. Each time exactly one of the two
  reports success, the other gets a CheckpointWriteError, and the checkpoint loads bitwise as
  the successful one's.
- In one process: a lock taken over makes the commit refuse; a commit after another save's
  commit is refused by the conditional PUT although the lock looks held; release() leaves
  another save's lock alone.
- A contender with a short lease never takes a live lock; where the store sends no ``Date``
  (a proxy strips it), a dead holder's lock is taken over once its ETag stays unchanged for the
  holder's lease, a live one's (renewed, so its ETag changes) never.
- A restart right after ``kill -9`` takes the lock at once (same machine, pid gone), and so does
  a restart of the same job on another machine (``lock_job``); another job's lock is waited for.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from faulty_proxy import FaultyProxy
from s3_data import SMALL_PARTS, assert_same, state_dict

import mmapckpt
from mmapckpt import CheckpointWriteError

HERE = os.path.dirname(__file__)
_LEASE = 2.0
#: a child that saves version ``salt`` and stops itself (SIGSTOP) at ``stop``; exit 3: its save was refused
_SAVER = textwrap.dedent("""
    import os, signal, sys, warnings
    warnings.filterwarnings("ignore")
    url, here, salt, stop, lease = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], float(sys.argv[5])
    sys.path.insert(0, here)
    import mmapckpt
    from mmapckpt.storage.s3 import lock as s3lock, storage as s3storage
    from s3_data import SMALL_PARTS, state_dict

    def stop_here():
        print("stopping", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)  # every thread stops: the lock's renewals too

    if stop == "before_check":
        commit = s3storage.S3Storage.commit
        def stopped_commit(self, *a, **k):
            stop_here()
            return commit(self, *a, **k)
        s3storage.S3Storage.commit = stopped_commit
    elif stop == "after_check":
        check = s3lock.S3Lock.check
        def stopped_check(self, what="commit"):
            check(self, what)
            if what == "commit":
                stop_here()
        s3lock.S3Lock.check = stopped_check
    sd = state_dict(salt=salt)
    print("ready", flush=True)
    try:
        mmapckpt.save(sd, url, storage_options={**SMALL_PARTS, "lock_lease": lease, "lock_wait": 60})
    except mmapckpt.CheckpointWriteError as e:
        print("refused:", e, flush=True)
        sys.exit(3)
    print("saved", flush=True)
""")


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID")}


def _saver(url: str, salt: int, stop: str, lease: float = _LEASE) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", _SAVER, url, HERE, str(salt), stop, str(lease)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env())


def _wait_line(child: subprocess.Popen[bytes], want: bytes) -> None:
    while True:
        line = child.stdout.readline()  # type: ignore[union-attr]
        assert line, f"the child ended before {want!r}: {child.stderr.read().decode()[-2000:]}"  # type: ignore[union-attr]
        if line.startswith(want):
            return


def _wait_stopped(child: subprocess.Popen[bytes]) -> None:
    _wait_line(child, b"stopping")
    for _ in range(3000):
        with open(f"/proc/{child.pid}/stat") as f:
            if f.read().rpartition(")")[2].split()[0] == "T":
                return
        time.sleep(0.01)
    raise AssertionError("the child did not stop")


def _finish(child: subprocess.Popen[bytes]) -> tuple[int, str, str]:
    out, err = child.communicate(timeout=120)
    return child.returncode, out.decode(), err.decode()


def _stop_all(children: list[subprocess.Popen[bytes]]) -> None:
    for c in children:
        if c.poll() is None:
            c.send_signal(signal.SIGKILL)  # SIGKILL ends a stopped process too
            c.wait(timeout=30)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_save_stalled_past_its_lease_never_commits_over_the_next(s3_env, s3_bucket):
    url = f"s3://{s3_bucket}/stalled"
    mmapckpt.save(state_dict(salt=0), url, storage_options=SMALL_PARTS)
    rng = random.Random(42)
    trials = [(order, stop) for order in ("resumes_after", "resumes_before") for stop in ("before_check", "after_check")]
    rng.shuffle(trials)
    for trial, (order, stop) in enumerate(trials):
        first, second = 2 * trial + 1, 2 * trial + 2
        children: list[subprocess.Popen[bytes]] = []
        try:
            a = _saver(url, first, stop)
            children.append(a)
            _wait_stopped(a)  # A holds the lock, its shards written, and stops before its commit
            time.sleep(rng.uniform(0, 1))
            # B's own lease is long: it stops only while A resumes, and judges A by A's lease, not its own
            b = _saver(url, second, "none" if order == "resumes_after" else "before_check", lease=30)
            children.append(b)
            if order == "resumes_after":
                code_b, out_b, err_b = _finish(b)  # B waits out A's lease, takes over, commits, removes A's shards
                a.send_signal(signal.SIGCONT)
                code_a, out_a, err_a = _finish(a)
            else:
                _wait_stopped(b)  # B took over and stops before its own commit
                a.send_signal(signal.SIGCONT)
                code_a, out_a, err_a = _finish(a)
                b.send_signal(signal.SIGCONT)
                code_b, out_b, err_b = _finish(b)
        finally:
            _stop_all(children)
        what = f"trial {trial} ({order}, A stopped {stop}): A {code_a} {out_a!r} {err_a[-800:]!r}; B {code_b} {out_b!r}"
        assert {code_a, code_b} == {0, 3}, what  # one committed, the other was refused (no traceback)
        winner = first if code_a == 0 else second
        if order == "resumes_after" or stop == "before_check":
            assert winner == second, what  # the stalled save finds the lock lost at its check
        assert_same(mmapckpt.load(url), state_dict(salt=winner))


def test_a_save_that_lost_its_lock_does_not_commit(s3_env, s3_bucket, s3_server):
    url = f"s3://{s3_bucket}/lost"
    storage = mmapckpt.MmapWriter(url, storage_options={"lock_lease": 600}).storage
    lock = storage.lock()
    try:
        # another save took the lock over (as after this one stalled past its lease)
        s3_server.client().put_object(Bucket=s3_bucket, Key="lost/.mmapckpt-lock", Body=b'{"owner": "other"}')
        with pytest.raises(CheckpointWriteError, match="lost its lock"):
            storage.commit(".metadata", b"whatever", sync=True)
        assert not storage.exists(".metadata")
        storage.remove(["notes.txt"], sync=True)  # removes nothing once the lock is lost
    finally:
        lock.release()
    client = s3_server.client()
    assert client.get_object(Bucket=s3_bucket, Key="lost/.mmapckpt-lock")["Body"].read() == b'{"owner": "other"}'


def test_a_commit_after_another_saves_commit_is_refused(s3_env, s3_bucket, s3_server):
    url = f"s3://{s3_bucket}/raced"
    mmapckpt.save({"a": torch.ones(3)}, url)
    storage = mmapckpt.MmapWriter(url).storage
    lock = storage.lock()
    try:
        # .metadata replaced after this save took the lock: only a save that stole it could have done that
        s3_server.client().put_object(Bucket=s3_bucket, Key="raced/.metadata", Body=b"another save's commit")
        with pytest.raises(CheckpointWriteError, match="commit was refused"):
            storage.commit(".metadata", b"this save's commit", sync=True)
    finally:
        lock.release()
    got = s3_server.client().get_object(Bucket=s3_bucket, Key="raced/.metadata")["Body"].read()
    assert got == b"another save's commit"


def test_a_first_commit_is_refused_where_another_save_committed_first(s3_env, s3_bucket, s3_server):
    url = f"s3://{s3_bucket}/fresh"
    storage = mmapckpt.MmapWriter(url).storage
    lock = storage.lock()
    try:
        s3_server.client().put_object(Bucket=s3_bucket, Key="fresh/.metadata", Body=b"another save's commit")
        with pytest.raises(CheckpointWriteError, match="commit was refused"):
            storage.commit(".metadata", b"this save's commit", sync=True)
    finally:
        lock.release()


def test_release_removes_only_its_own_lock(s3_env, s3_bucket, s3_server):
    url = f"s3://{s3_bucket}/mine"
    storage = mmapckpt.MmapWriter(url).storage
    lock = storage.lock()
    client = s3_server.client()
    client.put_object(Bucket=s3_bucket, Key="mine/.mmapckpt-lock", Body=b'{"owner": "next save"}')
    lock.release()
    assert client.get_object(Bucket=s3_bucket, Key="mine/.mmapckpt-lock")["Body"].read() == b'{"owner": "next save"}'


_HOLDER = textwrap.dedent("""
    import sys, time, warnings
    warnings.filterwarnings("ignore")
    import mmapckpt
    storage = mmapckpt.MmapWriter(sys.argv[1], storage_options={"lock_lease": float(sys.argv[2])}).storage
    lock = storage.lock()
    print("held", flush=True)
    time.sleep(600)
""")


def _holder(url: str, lease: float, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    child = subprocess.Popen([sys.executable, "-c", _HOLDER, url, str(lease)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, env=env or _env())
    try:
        _wait_line(child, b"held")
    except BaseException:
        _stop_all([child])
        raise
    return child


def _lock_owner(client, bucket: str, prefix: str) -> str:
    return json.loads(client.get_object(Bucket=bucket, Key=f"{prefix}/.mmapckpt-lock")["Body"].read())["owner"]


def test_a_short_lease_contender_never_takes_a_live_lock(s3_env, s3_bucket, s3_server):
    url = f"s3://{s3_bucket}/live"
    client = s3_server.client()
    holder = _holder(url, 20)  # renewed every 5 s
    try:
        owner = _lock_owner(client, s3_bucket, "live")
        time.sleep(2.5)  # older than the contender's 1 s lease by the store's clock
        with pytest.raises(CheckpointWriteError, match="holds this location's lock"):
            mmapckpt.save({"a": torch.ones(3)}, url, storage_options={"lock_lease": 1, "lock_wait": 4})
        assert _lock_owner(client, s3_bucket, "live") == owner
        assert holder.poll() is None
    finally:
        _stop_all([holder])
    assert not [o for o in client.list_objects_v2(Bucket=s3_bucket, Prefix="live/").get("Contents", [])
                if not o["Key"].endswith(".mmapckpt-lock")]


def test_without_a_store_date_a_dead_lock_expires_and_a_live_one_does_not(s3_env, s3_bucket, s3_server):
    proxy = FaultyProxy(("127.0.0.1", int(s3_server.endpoint_url.rsplit(":", 1)[1])), strip_date=True)
    try:
        through = {"endpoint_url": proxy.endpoint_url}
        client = s3_server.client()
        # a live holder (lease 4 s, renewed every 1 s): its ETag keeps changing, so it is never taken over. The
        # contender waits 8 s: longer than the 5 s after which an unchanged ETag would count as dead, so a
        # contender that did not watch the ETag change would take it; and a loaded machine may stall the holder
        # for up to 5 s without the test failing (it was 3 s with a 2 s lease)
        holder = _holder(f"s3://{s3_bucket}/live", 2 * _LEASE)
        try:
            with pytest.raises(CheckpointWriteError, match="no store clock"):
                mmapckpt.save({"a": torch.ones(3)}, f"s3://{s3_bucket}/live",
                              storage_options={**through, "lock_wait": 8})
            assert holder.poll() is None
        finally:
            _stop_all([holder])
        # a dead holder on another machine, lease 2 s, never renewed: taken over once unchanged for 2 s (+1)
        body = json.dumps({"owner": "dead", "host": "another-node", "pid": 7, "lease": _LEASE}).encode()
        client.put_object(Bucket=s3_bucket, Key="dead/.mmapckpt-lock", Body=body)
        mmapckpt.save({"a": torch.ones(3)}, f"s3://{s3_bucket}/dead", storage_options={**through, "lock_wait": 10})
        assert proxy.dates_stripped > 0
        assert_same(mmapckpt.load(f"s3://{s3_bucket}/dead"), {"a": torch.ones(3)})
    finally:
        proxy.close()


def test_a_restart_right_after_kill_9_saves_at_once(s3_env, s3_bucket, s3_server):
    url = f"s3://{s3_bucket}/killed"
    client = s3_server.client()
    holder = _holder(url, 600)  # a save holding the lock with a long lease, then killed
    holder.send_signal(signal.SIGKILL)
    holder.wait(timeout=30)
    _stop_all([holder])
    assert client.get_object(Bucket=s3_bucket, Key="killed/.mmapckpt-lock")  # left behind by the kill
    mmapckpt.save({"a": torch.ones(3)}, url, storage_options={"lock_wait": 0})  # no wait at all
    assert_same(mmapckpt.load(url), {"a": torch.ones(3)})


def test_a_restart_of_the_same_job_elsewhere_saves_at_once(s3_env, s3_bucket, s3_server, monkeypatch):
    client = s3_server.client()
    body = {"owner": "x", "host": "another-node", "pid": 7, "lease": 600, "job": "torchelastic:run-7"}
    for prefix in ("same", "other"):
        client.put_object(Bucket=s3_bucket, Key=f"{prefix}/.mmapckpt-lock", Body=json.dumps(body).encode())
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run-7")
    mmapckpt.save({"a": torch.ones(3)}, f"s3://{s3_bucket}/same", storage_options={"lock_wait": 0})
    assert_same(mmapckpt.load(f"s3://{s3_bucket}/same"), {"a": torch.ones(3)})
    with pytest.raises(CheckpointWriteError, match="job torchelastic:run-7"):  # another job's lock is waited for
        mmapckpt.save({"a": torch.ones(3)}, f"s3://{s3_bucket}/other",
                      storage_options={"lock_wait": 0, "lock_job": "run-8"})


def test_a_waiting_save_logs_whom_it_waits_for_once(s3_env, s3_bucket, caplog):
    url = f"s3://{s3_bucket}/wait"
    storage = mmapckpt.MmapWriter(url).storage
    lock = storage.lock()
    try:
        with caplog.at_level("WARNING", logger="mmapckpt"), pytest.raises(CheckpointWriteError):
            mmapckpt.save({"a": torch.ones(3)}, url, storage_options={"lock_wait": 1.5})
    finally:
        lock.release()
    waits = [r for r in caplog.records if "waiting up to" in r.getMessage()]
    assert len(waits) == 1 and f"pid {os.getpid()}" in waits[0].getMessage(), caplog.text
