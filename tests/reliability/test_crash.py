"""Crash-safe saves: a save killed with SIGKILL at any moment never leaves a checkpoint that loads wrong.

A child process (forked from a server that imported torch once) saves a deterministic state dict with ``dcp.save(..., MmapWriter)``
and is killed. After every kill, ``dcp.load`` through ``MmapReader(verify=True)``
must either return, bit for bit, the version that was being saved or the one
committed before it, or raise ``IncompleteCheckpointError`` (``CheckpointNotFoundError``
only while the directory holds nothing of a checkpoint yet). Nothing else.

Two kinds of trials:

* timed kills: SIGKILL from outside after a random delay spread over the measured
  duration of a save (about 100 MB over 1 or 2 shard files);
* event kills: the child counts its own file-system calls during the save (open for
  writing, ftruncate, pwrite, fsync, replace, unlink) and kills itself just before
  the k-th one (writing half of the buffer first when it is a pwrite), so that every
  step - old commit removal, shard data, shard header, shard rename, directory sync,
  metadata write, metadata rename - is hit deterministically.

Trials are chained: each save goes over whatever the previous trial left.
``MMAPCKPT_CRASH_TRIALS``, ``MMAPCKPT_CRASH_MB`` and ``MMAPCKPT_CRASH_ALL_EVENTS=1``
enlarge the runs (docs/reliability.md gives the figures of a long run).
"""

from __future__ import annotations

import glob
import json
import logging
import os
import random
import re
import signal
import subprocess
import sys
import time
from typing import Any

import pytest
import torch

from helpers import close_fork_server, dcp_failure, dcp_load, tensor_bytes

import mmapckpt
from mmapckpt import CheckpointNotFoundError, IncompleteCheckpointError, MmapReader

TESTS = os.path.dirname(os.path.abspath(__file__))
#: tests/, where helpers.py and strategies.py live (subprocesses put both on sys.path)
TESTS_ROOT = os.path.dirname(TESTS)
TIMED_TRIALS = int(os.environ.get("MMAPCKPT_CRASH_TRIALS", "20"))
TIMED_MB = int(os.environ.get("MMAPCKPT_CRASH_MB", "96"))
EVENT_MB = 4
ALL_EVENTS = os.environ.get("MMAPCKPT_CRASH_ALL_EVENTS") == "1"


# --------------------------------------------------------------------------- the saved state
def make_state(version: int, mb: int) -> dict[str, Any]:
    """A deterministic state dict of about ``mb`` MiB; every version has the same shapes, other bytes."""
    g = torch.Generator().manual_seed(7919 * version + 13)
    n = max(1, mb * 2**20 // 4 // 8)
    sd: dict[str, Any] = {f"layer{i}.weight": torch.randn(n, generator=g) for i in range(5)}
    sd["layer5.bf16"] = torch.randn(n, generator=g).to(torch.bfloat16)
    sd["layer6.int"] = torch.randint(-2**31, 2**31 - 1, (n // 2, 2), generator=g, dtype=torch.int32)
    sd["odd.fp8"] = torch.randint(0, 256, (4097,), generator=g, dtype=torch.uint8).view(torch.float8_e4m3fn)
    # NaNs with distinct payloads and a negative zero: only a bitwise comparison sees them
    bits = torch.tensor([0x7FC00001 + version, 0xFFC00002, 0x80000000, version], dtype=torch.int64)
    sd["special"] = bits.to(torch.int32).view(torch.float32)
    sd["version"] = torch.tensor([version], dtype=torch.int64)
    sd["extra"] = {"step": version, "note": "x" * (version % 7)}
    return sd


def _targets(mb: int) -> dict[str, Any]:
    sd = make_state(0, mb)
    return {k: (torch.empty_like(v) if isinstance(v, torch.Tensor) else {"step": -1, "note": ""})
            for k, v in sd.items()}


# --------------------------------------------------------------------------- child process
class _Killer:
    """Counts file-system calls during the save and SIGKILLs the process before call number ``kill_at``."""

    def __init__(self, kill_at: int) -> None:
        self.kill_at, self.names, self.armed = kill_at, [], False

    def hit(self, name: str, partial: Any = None) -> None:
        if not self.armed:
            return
        if len(self.names) == self.kill_at:
            if partial is not None:
                partial()
            os.kill(os.getpid(), signal.SIGKILL)
        self.names.append(name)


def _install(k: _Killer) -> None:
    real = {n: getattr(os, n) for n in ("pwrite", "fsync", "replace", "rename", "unlink", "ftruncate", "open")}

    def pwrite(fd: int, data: Any, off: int) -> int:
        def half() -> None:
            mv = memoryview(data).cast("B")
            real["pwrite"](fd, mv[: len(mv) // 2], off)
        k.hit("pwrite", half)
        return real["pwrite"](fd, data, off)

    def opener(path: Any, flags: int, *a: Any, **kw: Any) -> int:
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            k.hit("open:" + os.path.basename(os.fspath(path)).split(".tmp-")[0])
        return real["open"](path, flags, *a, **kw)

    def wrap(name: str) -> Any:
        def f(*a: Any, **kw: Any) -> Any:
            k.hit(name)
            return real[name](*a, **kw)
        return f

    os.pwrite, os.open = pwrite, opener  # type: ignore[assignment]
    for n in ("fsync", "replace", "rename", "unlink", "ftruncate"):
        setattr(os, n, wrap(n))


def _save_in_child(path: str, version: int, mb: int, threads: int, kill_at: int) -> None:
    """Runs in a forked child: save; ``kill_at >= 0`` SIGKILLs before that file-system call."""
    import torch.distributed.checkpoint as dcp

    torch.set_num_threads(1)
    sd = make_state(version, mb)
    k = _Killer(kill_at)
    _install(k)
    print("READY", flush=True)
    t0 = time.perf_counter()
    k.armed = True
    dcp.save(sd, storage_writer=mmapckpt.MmapWriter(path, thread_count=threads), no_dist=True)
    k.armed = False
    print("DONE", json.dumps({"seconds": time.perf_counter() - t0, "events": k.names}), flush=True)


def server_main() -> None:
    """A fork server: torch is imported once; every save runs in a fresh forked child.

    Reads one JSON command per line; answers ``PID n``, then the child's own lines
    (``READY``, ``DONE {...}``), then ``EXIT code`` (negative: killed by that signal).
    """
    import warnings

    import torch.distributed.checkpoint  # noqa: F401  (imported before forking)

    warnings.simplefilter("ignore")
    for line in sys.stdin:
        cmd = json.loads(line)
        sys.stdout.flush()
        go_r, go_w = os.pipe()  # the child starts only after "PID n" is out, so its lines come after it
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                os.close(go_w)
                os.read(go_r, 1)
                _save_in_child(cmd["path"], cmd["version"], cmd["mb"], cmd["threads"], cmd["kill_at"])
            except BaseException:
                import traceback
                traceback.print_exc()
                code = 1
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        print("PID", pid, flush=True)
        os.close(go_r)
        os.write(go_w, b"g")
        os.close(go_w)
        sys.stdin.readline()  # reap only when told: until then the pid cannot be reused, so killing it is safe
        _, status = os.waitpid(pid, 0)
        print("EXIT", os.waitstatus_to_exitcode(status), flush=True)


class _Saver:
    """The test side of the fork server."""

    def __init__(self) -> None:
        code = f"import sys; sys.path[:0] = [{TESTS!r}, {TESTS_ROOT!r}]; import test_crash; test_crash.server_main()"
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, bufsize=1)
        self.child: int | None = None  # started and not yet reaped: its pid is still its own

    def _line(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, f"fork server died (exit {self.proc.poll()})"
        return line.strip()

    def start(self, path: str, version: int, mb: int, threads: int = 1, kill_at: int = -1) -> int:
        assert self.proc.stdin is not None
        cmd = {"path": path, "version": version, "mb": mb, "threads": threads, "kill_at": kill_at}
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        tag, pid = self._line().split()
        assert tag == "PID", tag
        self.child = int(pid)
        return self.child

    def wait_ready(self) -> None:
        line = self._line()
        assert line == "READY", line

    def finish(self) -> tuple[int, dict[str, Any] | None]:
        """Read up to ``EXIT``; return the exit code and the DONE record, if the save finished."""
        assert self.proc.stdin is not None
        self.child = None  # once told, the server may reap it and its pid may be reused
        self.proc.stdin.write("reap\n")
        self.proc.stdin.flush()
        done = None
        while True:
            line = self._line()
            if line.startswith("DONE"):
                try:
                    done = json.loads(line[4:])
                except ValueError:
                    # killed while writing DONE after its save (a long line takes several writes):
                    # the server's EXIT follows on the same line, after the cut-off record
                    _, sep, tail = line.rpartition("EXIT ")
                    if not sep:
                        raise
                    return int(tail.split()[0]), None
            elif line.startswith("EXIT"):
                return int(line.split()[1]), done

    def run_to_end(self, path: str, version: int, mb: int, threads: int = 1) -> dict[str, Any]:
        self.start(path, version, mb, threads)
        code, done = self.finish()
        assert code == 0 and done is not None, f"save failed with exit code {code} (see stderr)"
        return done

    def close(self) -> None:
        close_fork_server(self.proc, self.child)


@pytest.fixture(scope="module")
def saver():
    s = _Saver()
    yield s
    s.close()


# --------------------------------------------------------------------------- the check after a kill
def _phase(path: str, t_start_ns: int) -> str:
    """Where the save was when it died, from what it left in the directory."""
    def new(pattern: str) -> list[str]:
        return [p for p in glob.glob(os.path.join(glob.escape(path), pattern)) if os.stat(p).st_mtime_ns >= t_start_ns]
    if os.path.exists(os.path.join(path, ".metadata")):
        return "committed (killed before the save began or after it committed)"
    if new("..metadata.tmp-*"):
        return "writing metadata"
    if new(".__*.distcp.tmp-*"):
        return "writing shards"
    if new("__*.distcp"):
        return "between shards and metadata"
    return "old commit removed, no shard written yet"


def _check_after_kill(path: str, allowed: list[int], targets: dict[str, Any], mb: int,
                      expected: dict[int, dict[str, Any]]) -> int | None:
    """Load; return the version loaded (bitwise checked) or None for an incomplete checkpoint."""
    for k, v in targets.items():  # poison the targets so stale contents cannot pass for loaded ones
        if isinstance(v, torch.Tensor):
            v.view(torch.uint8).fill_(0xA5) if v.numel() else None
        else:
            targets[k] = {"step": -1, "note": ""}
    try:
        MmapReader(path).read_metadata()
    except (IncompleteCheckpointError, CheckpointNotFoundError) as err:
        if isinstance(err, CheckpointNotFoundError):
            leftovers = glob.glob(os.path.join(glob.escape(path), "*.distcp*"))
            leftovers += glob.glob(os.path.join(glob.escape(path), ".*.distcp*"))
            assert not leftovers, f"'not found' although shard files exist: {leftovers}"
        # dcp.load (torch 2.13) catches every read_metadata error and raises
        # AssertionError("metadata is None; global metadata read failed: <our message>")
        logging.disable(logging.WARNING)  # DCP logs each failed read_metadata with a traceback
        try:
            with pytest.raises(BaseException) as info:
                dcp_load(targets, MmapReader(path, verify=True))
        finally:
            logging.disable(logging.NOTSET)
        assert str(err) in str(dcp_failure(info.value)), dcp_failure(info.value)
        return None
    try:
        dcp_load(targets, MmapReader(path, verify=True))
    except BaseException as e:  # CheckpointException is a BaseException
        err = dcp_failure(e)
        raise AssertionError(f"load after a kill raised {type(err).__name__}: {err}") from err
    v = int(targets["version"].item())
    assert v in allowed, f"loaded version {v}, only {allowed} may be there"
    if v not in expected:
        expected[v] = make_state(v, mb)
    for key, want in expected[v].items():
        got = targets[key]
        if isinstance(want, torch.Tensor):
            assert got.dtype == want.dtype and got.shape == want.shape, key
            assert tensor_bytes(got) == tensor_bytes(want), f"version {v}: {key} differs"
        else:
            assert got == want, f"version {v}: {key}: {got!r} != {want!r}"
    return v


def _report(name: str, phases: dict[str, int], outcomes: dict[str, int]) -> None:
    print(f"\n{name}: phases {json.dumps(phases, indent=1)}\noutcomes {json.dumps(outcomes)}")


# --------------------------------------------------------------------------- tests
@pytest.mark.slow
def test_sigkill_at_random_moments(tmp_path, saver):
    path = str(tmp_path / "ckpt")
    mb = TIMED_MB
    # four saves to the end: the last (version 0) is committed; the kills' delays spread over
    # the median duration of the three saves made over an existing checkpoint
    durations = [saver.run_to_end(path, v, mb, t)["seconds"] for v, t in ((-3, 2), (-2, 1), (-1, 2), (0, 1))]
    duration = sorted(durations[1:])[1]
    targets, expected = _targets(mb), {}
    committed: int | None = 0
    assert _check_after_kill(path, [0], targets, mb, expected) == 0
    rng = random.Random(20261202)
    slots = list(range(TIMED_TRIALS))
    rng.shuffle(slots)
    phases: dict[str, int] = {}
    outcomes = {"old": 0, "new": 0, "incomplete": 0}
    for trial, slot in enumerate(slots, start=1):
        delay = duration * 1.2 * (slot + rng.random()) / TIMED_TRIALS
        t_start = time.time_ns()
        pid = saver.start(path, trial, mb, 1 + trial % 2)
        saver.wait_ready()
        time.sleep(delay)
        os.kill(pid, signal.SIGKILL)  # not reaped before finish(): the pid is still the child's (maybe a zombie)
        code, done = saver.finish()
        assert code == -signal.SIGKILL or (code == 0 and done is not None), code
        phase = _phase(path, t_start)
        phases[phase] = phases.get(phase, 0) + 1
        allowed = [trial] + ([committed] if committed is not None else [])
        got = _check_after_kill(path, allowed, targets, mb, expected)
        outcomes["incomplete" if got is None else ("new" if got == trial else "old")] += 1
        committed = got
        expected = {v: sd for v, sd in expected.items() if v in (committed, trial + 1)}
    _report(f"{TIMED_TRIALS} timed SIGKILLs ({mb} MiB, saves took {durations} s)", phases, outcomes)
    assert sum(outcomes.values()) == TIMED_TRIALS
    # every kill fell on a save over a committed checkpoint: each left the old one or the new one
    assert outcomes["incomplete"] == 0, outcomes
    # a clean save afterwards commits, loads, and removes every file the kills left behind
    saver.run_to_end(path, 999, mb, 2)
    assert _check_after_kill(path, [999], targets, mb, {}) == 999
    names = sorted(os.listdir(path))
    assert names[0] == ".metadata" and len(names) == 3 and all(
        re.fullmatch(r"__0_[01](\.[0-9a-f]{8})?\.distcp", n) for n in names[1:]), names


def _pick_events(names: list[str]) -> list[int]:
    """Every event when asked; otherwise the first of each kind, the middle and last pwrites, and the last event."""
    if ALL_EVENTS:
        return list(range(len(names) + 1))
    picks, seen = set(), set()
    for i, n in enumerate(names):
        if n not in seen:
            seen.add(n)
            picks.add(i)
    writes = [i for i, n in enumerate(names) if n == "pwrite"]
    picks.update({writes[len(writes) // 2], writes[-1], writes[-2], len(names) - 1, len(names)})
    picks.update(i for i, n in enumerate(names) if n == "replace")  # shard rename and metadata rename
    return sorted(picks)


def test_sigkill_at_every_step_of_a_save(tmp_path, saver):
    path = str(tmp_path / "ckpt")
    mb = EVENT_MB
    names = saver.run_to_end(path, 0, mb)["events"]  # a save over nothing: events from makedirs on
    names_over = saver.run_to_end(path, 1, mb)["events"]  # a save over a checkpoint
    assert names_over.count("replace") == 2, names_over  # one shard, then the metadata
    commit_at = len(names_over) - 1 - names_over[::-1].index("replace")
    # nothing is removed before the new metadata is renamed over the old: the old commit stays loadable
    assert "unlink" not in names_over[:commit_at] and "unlink" in names_over[commit_at:], names_over
    targets, expected = _targets(mb), {}
    committed: int | None = 1
    phases: dict[str, int] = {}
    outcomes = {"old": 0, "new": 0, "incomplete": 0}
    picks = _pick_events(names_over)
    for trial, kill_at in enumerate(picks, start=2):
        t_start = time.time_ns()
        saver.start(path, trial, mb, 1, kill_at)
        code, _ = saver.finish()
        # the call sequence up to the metadata rename does not depend on what earlier kills left behind;
        # after it, removing their leftover temp files adds calls, so the last pick may still kill
        assert code == -signal.SIGKILL or kill_at >= len(names_over), (kill_at, code)
        phase = f"before {names_over[kill_at]} #{kill_at}" if kill_at < len(names_over) else "after the last call"
        phases[phase] = phases.get(phase, 0) + 1
        allowed = [trial] + ([committed] if committed is not None else [])
        got = _check_after_kill(path, allowed, targets, mb, expected)
        outcomes["incomplete" if got is None else ("new" if got == trial else "old")] += 1
        if kill_at <= commit_at:  # before the metadata rename: the old checkpoint, bit for bit
            assert got == committed, f"killed before {names_over[kill_at]} #{kill_at} but version {got} loaded"
        else:  # metadata renamed: committed
            assert got == trial, f"killed after the metadata rename but loaded {got}"
        committed = got
        expected = {v: sd for v, sd in expected.items() if v in (committed, trial + 1)}
    _report(f"{len(picks)} event kills out of {len(names_over)} calls", phases, outcomes)
    assert outcomes["incomplete"] == 0 and outcomes["old"] > 0 and outcomes["new"] > 0, outcomes


def test_sigkill_of_a_first_save_into_a_new_directory(tmp_path, saver):
    """Before the first shard exists there is no checkpoint at all; afterwards the directory is incomplete."""
    mb = EVENT_MB
    names = saver.run_to_end(str(tmp_path / "probe"), 0, mb)["events"]
    first_shard_open = next(i for i, n in enumerate(names) if n.startswith("open:"))
    targets = _targets(mb)
    for kill_at in (first_shard_open, first_shard_open + 1, names.index("replace") + 1):
        path = str(tmp_path / f"k{kill_at}")
        saver.start(path, 5, mb, 1, kill_at)
        assert saver.finish()[0] == -signal.SIGKILL
        assert _check_after_kill(path, [], targets, mb, {}) is None
        with pytest.raises((IncompleteCheckpointError, CheckpointNotFoundError)):
            MmapReader(path).read_metadata()
    with pytest.raises(IncompleteCheckpointError):  # the shard was renamed into place, no metadata yet
        MmapReader(str(tmp_path / f"k{names.index('replace') + 1}")).read_metadata()


@pytest.mark.parametrize("first,second", [(True, False), (False, True)])
def test_saving_in_the_other_collectives_mode_removes_the_other_commit(tmp_path, first, second):
    """A save with use_collectives=False commits __0.metadata, a collective one .metadata; both name
    __0_0.distcp. Each save removes the other kind of commit before writing, so no metadata of an
    earlier save is left describing the new shards."""
    import torch.distributed.checkpoint as dcp

    path = str(tmp_path / "ckpt")
    dcp.save(make_state(1, 1), storage_writer=mmapckpt.MmapWriter(path), no_dist=True, use_collectives=first)
    dcp.save(make_state(2, 1), storage_writer=mmapckpt.MmapWriter(path), no_dist=True, use_collectives=second)
    commits = sorted(n for n in os.listdir(path) if n.endswith(".metadata"))
    assert commits == ([".metadata"] if second else ["__0.metadata"]), commits
    got = dcp_load(_targets(1), MmapReader(path))  # dcp.load falls back to __0.metadata by itself
    for key, want in make_state(2, 1).items():
        if isinstance(want, torch.Tensor):
            assert tensor_bytes(got[key]) == tensor_bytes(want), key
    with pytest.raises(BaseException) as info:  # either kind of commit counts as an existing checkpoint
        dcp.save(make_state(3, 1), storage_writer=mmapckpt.MmapWriter(path, overwrite=False), no_dist=True,
                 use_collectives=first)
    assert isinstance(dcp_failure(info.value), mmapckpt.CheckpointExistsError), dcp_failure(info.value)
