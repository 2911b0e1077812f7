"""A save over an existing checkpoint never loses it: the directory loads as the old or the new one, always.

At every instant of a save over a checkpoint (``MmapWriter(path)``, ``overwrite=True``; also
``mmapckpt.save``), the directory must load - through ``dcp.load`` + ``MmapReader``,
``mmapckpt.load`` and ``mmapckpt.open`` - as exactly the old checkpoint or exactly the new one,
bitwise: never an error, never a mix. The tests here:

* SIGKILL at random moments over the whole save, including after the commit while stale files
  are removed (``dcp.save``: ``MMAPCKPT_OVERWRITE_TRIALS`` trials of ``MMAPCKPT_OVERWRITE_MB``
  MiB; ``mmapckpt.save``; ``use_collectives=False``), and before every file-system call of a save;
* a 2-rank gloo save where one rank raises in ``write_data`` or is SIGKILLed there;
* ENOSPC (a real 64 MiB tmpfs where it can be mounted, and injected) and EIO while writing;
* leftovers of killed saves removed by the next save, files that are not the checkpoint's kept;
* two writers into one directory at once: the second is refused with ``CheckpointWriteError``,
  and a killed lock holder does not block the next save.

The old and the new checkpoint always have different layouts (keys, shapes, dtypes, number of
shard files; tests/reliability/overwrite_child.py), so which one loaded is never in doubt, and
every element of every version has other bits than the same element of any other version.
Outcome counts are printed (``-s``) and, with ``MMAPCKPT_TRIALS_OUT=<file.json>``, written there.
"""

from __future__ import annotations

import errno
import fnmatch
import gc
import itertools
import json
import logging
import multiprocessing
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Iterator

import pytest
import torch
import torch.distributed.checkpoint as dcp

import mmapckpt
from mmapckpt import CheckpointWriteError, MmapReader, MmapWriter

import overwrite_child as oc
from helpers import close_fork_server, dcp_failure, mounted, stop_processes

TESTS = os.path.dirname(os.path.abspath(__file__))
TESTS_ROOT = os.path.dirname(TESTS)
DIST = os.path.join(TESTS_ROOT, "distributed")
if DIST not in sys.path:
    sys.path.insert(0, DIST)

import overwrite_ranks as orr  # noqa: E402  (tests/distributed, put on sys.path above)

TRIALS = int(os.environ.get("MMAPCKPT_OVERWRITE_TRIALS", "100"))  # 200 in the run of record (docs/reliability.md)
TRIALS_SAVE = int(os.environ.get("MMAPCKPT_OVERWRITE_TRIALS_SAVE", "40"))
TRIALS_NOCOLL = int(os.environ.get("MMAPCKPT_OVERWRITE_TRIALS_NOCOLL", "30"))
MB = int(os.environ.get("MMAPCKPT_OVERWRITE_MB", "192"))
MB_SMALL = int(os.environ.get("MMAPCKPT_OVERWRITE_MB_SMALL", "48"))
LOADERS = ("dcp", "load", "open")
FOREIGN = {"notes.txt": b"my notes\n", "config.json": b'{"lr": 0.001}\n', os.path.join("logs", "run.log"): b"step 1\n"}


# ---------------------------------------------------------------------------- comparing and classifying
def same_bits(a: Any, b: Any) -> bool:
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return False
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    x, y = a.detach().reshape(-1).view(torch.uint8), b.detach().reshape(-1).view(torch.uint8)
    if x.numel() % 8 == 0:
        try:
            return torch.equal(x.view(torch.int64), y.view(torch.int64))
        except RuntimeError:  # a view not aligned for int64
            pass
    return torch.equal(x, y)


def _differences(got: dict[str, Any], want: dict[str, Any]) -> list[str]:
    if set(got) != set(want):
        return [f"keys differ: missing {sorted(set(want) - set(got))[:5]}, extra {sorted(set(got) - set(want))[:5]}"]
    bad = []
    for k, w in want.items():
        g = got[k]
        if isinstance(w, torch.Tensor):
            if not same_bits(g, w):
                what = f"{tuple(g.shape)} {g.dtype}" if isinstance(g, torch.Tensor) else type(g).__name__
                bad.append(f"{k}: {what} differs from the expected {tuple(w.shape)} {w.dtype}")
        elif g != w:
            bad.append(f"{k}: {g!r} != {w!r}")
    return bad


_TARGETS: dict[tuple[str, ...], dict[str, Any]] = {}


def _poisoned_targets(want: dict[str, Any]) -> dict[str, Any]:
    """Load targets shaped like ``want``, every byte 0xA5 (reused between calls of one layout)."""
    sig = tuple(f"{k}:{tuple(v.shape)}:{v.dtype}" if isinstance(v, torch.Tensor) else k for k, v in want.items())
    if sig not in _TARGETS:
        if len(_TARGETS) > 4:
            _TARGETS.clear()
        _TARGETS[sig] = {k: torch.empty_like(v) if isinstance(v, torch.Tensor) else None for k, v in want.items()}
    out = {}
    for k, v in _TARGETS[sig].items():
        if isinstance(v, torch.Tensor):
            if v.numel():
                v.reshape(-1).view(torch.uint8).fill_(0xA5)
            out[k] = v
        else:
            out[k] = -1 if isinstance(want[k], int) else ""
    return out


def _load(loader: str, path: str, want: dict[str, Any], rank_commit: bool) -> dict[str, Any]:
    objects = any(not isinstance(v, torch.Tensor) for v in want.values())
    if loader == "dcp":
        targets = _poisoned_targets(want)
        dcp.load(targets, storage_reader=MmapReader(path), no_dist=True)
        return dict(targets)
    assert not rank_commit, "mmapckpt.load/open read the collective .metadata only"
    if loader == "load":
        return mmapckpt.load(path, allow_unpickle=objects)
    with mmapckpt.open(path) as f:
        return {k: (f.get_tensor(k) if isinstance(want.get(k), torch.Tensor) or k not in want
                    else f.get_object(k, allow_unpickle=True)) for k in f.keys()}


def classify(path: str, candidates: dict[str, dict[str, Any]], loaders: tuple[str, ...] = LOADERS,
             rank_commit: bool = False) -> tuple[str, str]:
    """Which candidate the directory loads as, bitwise, through every loader.

    Returns (label, detail): a key of ``candidates``, "lost" (a loader raised) or "mixed"
    (something loaded that is neither candidate, or the loaders disagree).
    """
    try:
        md = MmapReader(path).read_metadata(**({"rank": 0} if rank_commit else {}))
    except BaseException as e:
        return "lost", f"read_metadata: {type(e).__name__}: {e}"
    keys = set(md.state_dict_metadata)
    match = [label for label, want in candidates.items() if set(want) == keys]
    if len(match) != 1:
        return "mixed", f"the committed metadata's keys match {match or 'no candidate'}"
    label, want = match[0], candidates[match[0]]
    verdicts = []
    logging.disable(logging.WARNING)  # DCP logs each failed read with a traceback
    try:
        for loader in loaders:
            try:
                got = _load(loader, path, want, rank_commit)
            except BaseException as e:  # CheckpointException is a BaseException
                err = dcp_failure(e)
                verdicts.append(("lost", f"{loader}: {type(err).__name__}: {str(err)[:300]}"))
                continue
            bad = _differences(got, want)
            del got
            verdicts.append(("mixed", f"{loader}: {label}'s metadata but {bad[:3]}") if bad else (label, loader))
    finally:
        logging.disable(logging.NOTSET)
    for worst in ("mixed", "lost"):
        hits = [d for v, d in verdicts if v == worst]
        if hits:
            return worst, "; ".join(hits)
    return label, ""


class States:
    """Expected states of (version, layout), built on demand, the last few kept."""

    def __init__(self, mb: int, objects: bool) -> None:
        self.mb, self.objects, self.cache = mb, objects, {}

    def __call__(self, version: int, layout: str) -> dict[str, Any]:
        key = (version, layout)
        if key not in self.cache:
            if len(self.cache) >= 3:
                self.cache.pop(next(iter(self.cache)))
            self.cache[key] = oc.make_state(version, layout, self.mb, objects=self.objects)
        return self.cache[key]


# ---------------------------------------------------------------------------- directory checks
def plant_foreign(path: str) -> None:
    for rel, data in FOREIGN.items():
        os.makedirs(os.path.dirname(os.path.join(path, rel)), exist_ok=True)
        with open(os.path.join(path, rel), "wb") as f:
            f.write(data)


def assert_foreign_kept(path: str) -> None:
    for rel, data in FOREIGN.items():
        p = os.path.join(path, rel)
        assert os.path.isfile(p), f"{rel} (not a checkpoint file) was removed"
        with open(p, "rb") as f:
            assert f.read() == data, f"{rel} was changed"


def leftovers(path: str, rank_commit: bool = False) -> list[str]:
    """Temp files, and shard files no committed metadata references."""
    names = os.listdir(path)
    left = [n for n in names if ".tmp-" in n]
    try:
        md = MmapReader(path).read_metadata(**({"rank": 0} if rank_commit else {}))
        referenced = {info.relative_path for info in (md.storage_data or {}).values()}
    except BaseException:
        referenced = set()
    left += [n for n in names if fnmatch.fnmatch(n, "__*_*.distcp") and n not in referenced]
    return sorted(left)


def report(name: str, data: dict[str, Any]) -> None:
    print(f"\n{name}: {json.dumps(data, indent=1)}")
    out = os.environ.get("MMAPCKPT_TRIALS_OUT")
    if out:
        try:
            with open(out) as f:
                doc = json.load(f)
        except (OSError, ValueError):
            doc = {}
        doc[name] = data
        with open(out, "w") as f:
            json.dump(doc, f, indent=1)


# ---------------------------------------------------------------------------- the fork server
class Server:
    """The test side of overwrite_child.server_main (one forked child per save)."""

    def __init__(self) -> None:
        code = (f"import sys; sys.path[:0] = [{TESTS!r}, {TESTS_ROOT!r}]; import overwrite_child; "
                "overwrite_child.server_main()")
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, bufsize=1)
        self.child: int | None = None  # started and not yet reaped: its pid is still its own

    def line(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, f"fork server died (exit {self.proc.poll()})"
        return line.strip()

    def start(self, **cmd: Any) -> int:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        tag, pid = self.line().split()
        assert tag == "PID", tag
        self.child = int(pid)
        return self.child

    def expect(self, want: str) -> None:
        line = self.line()
        assert line == want, f"expected {want!r} from the child, got {line!r} (its traceback is on stderr)"

    def finish(self) -> tuple[int, dict[str, Any] | None]:
        """Reap the child; its exit code (negative: the signal) and its DONE record."""
        assert self.proc.stdin is not None
        self.child = None  # once told, the server may reap it and its pid may be reused
        self.proc.stdin.write("reap\n")
        self.proc.stdin.flush()
        done = None
        while True:
            line = self.line()
            if line.startswith("DONE"):
                done = json.loads(line[4:])
            elif line.startswith("EXIT"):
                return int(line.split()[1]), done

    def run_to_end(self, **cmd: Any) -> dict[str, Any]:
        self.start(**cmd)
        code, done = self.finish()
        assert code == 0 and done is not None, f"save {cmd} failed with exit code {code} (see stderr)"
        return done

    def close(self) -> None:
        close_fork_server(self.proc, self.child)


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    s = Server()
    yield s
    s.close()


# ---------------------------------------------------------------------------- the classifier itself
def test_classifier_tells_old_new_lost_and_mixed(tmp_path):
    mb = 2
    states = States(mb, objects=True)
    old, new = states(1, "A"), states(2, "B")
    for a, b in ((states(1, "A"), oc.make_state(3, "A", mb)), (new, oc.make_state(4, "B", mb))):
        for k, v in a.items():  # two versions of one layout differ in every element
            if isinstance(v, torch.Tensor) and v.numel() > 1 and v.dtype != torch.bool and k != "special":
                iv = oc._INT_VIEW[v.element_size()]
                assert bool((v.view(iv) != b[k].view(iv)).all()), k
    cands = {"old": old, "new": new}
    d_old, d_new, d_other = (str(tmp_path / n) for n in ("old", "new", "other"))
    dcp.save(old, storage_writer=MmapWriter(d_old, thread_count=3), no_dist=True)
    dcp.save(new, storage_writer=MmapWriter(d_new, thread_count=2), no_dist=True)
    dcp.save(oc.make_state(3, "A", mb), storage_writer=MmapWriter(d_other, thread_count=3), no_dist=True)
    assert classify(d_old, cands) == ("old", "")
    assert classify(d_new, cands) == ("new", "")
    # same layout as old, other bytes: the metadata matches old's keys, the bytes do not
    label, detail = classify(d_other, cands)
    assert label == "mixed" and all(f"{ld}:" in detail for ld in LOADERS), detail
    # a flipped data byte (read without verify): every loader sees the difference
    d_flip = str(tmp_path / "flip")
    shutil.copytree(d_old, d_flip)
    md = MmapReader(d_flip).read_metadata()
    idx, info = next((i, s) for i, s in md.storage_data.items() if i.fqn == "model.layer2.weight")
    shard = info.relative_path
    with open(os.path.join(d_flip, shard), "r+b") as f:  # one bit in the middle of a tensor's bytes
        f.seek(info.offset + info.length // 2)
        byte = f.read(1)
        f.seek(info.offset + info.length // 2)
        f.write(bytes([byte[0] ^ 0x01]))
    label, detail = classify(d_flip, cands)
    assert label == "mixed" and all(f"{ld}:" in detail for ld in LOADERS), detail
    # no commit: lost
    d_gone = str(tmp_path / "gone")
    shutil.copytree(d_new, d_gone)
    os.unlink(os.path.join(d_gone, ".metadata"))
    assert classify(d_gone, cands)[0] == "lost"
    # a shard of another save under a referenced name: lost (the save id differs) or mixed, never old
    d_swap = str(tmp_path / "swap")
    shutil.copytree(d_old, d_swap)
    shutil.copy(os.path.join(d_other, shard), os.path.join(d_swap, shard))
    assert classify(d_swap, cands)[0] in ("lost", "mixed")
    # tensors only (mmapckpt.save), and a per-rank commit (use_collectives=False) through dcp.load
    plain = oc.make_state(5, "B", mb, objects=False)
    mmapckpt.save(plain, str(tmp_path / "plain"))
    assert classify(str(tmp_path / "plain"), {"old": old, "new": plain}) == ("new", "")
    dcp.save(new, storage_writer=MmapWriter(str(tmp_path / "nocoll")), no_dist=True, use_collectives=False)
    assert classify(str(tmp_path / "nocoll"), cands, ("dcp",), rank_commit=True) == ("new", "")
    assert leftovers(d_old) == [] and leftovers(d_gone) == sorted(n for n in os.listdir(d_gone) if "distcp" in n)


# ---------------------------------------------------------------------------- SIGKILL at random moments
def _kill_trials(tmp_path, server: Server, op: str, trials: int, mb: int, name: str, seed: int) -> None:
    path = str(tmp_path / "ckpt")
    os.makedirs(path)
    plant_foreign(path)
    rank_commit = op == "dcp_nocoll"
    loaders = ("dcp",) if rank_commit else LOADERS
    states = States(mb, objects=op != "save")
    versions = itertools.count(1)

    def clean_save(layout: str) -> tuple[tuple[int, str], float]:
        v = next(versions)
        done = server.run_to_end(op=op, path=path, version=v, layout=layout, mb=mb)
        return (v, layout), done["seconds"]

    # a first save, then four overwrites (B over A, A over B, ...) to measure the duration of each
    committed, _ = clean_save("A")
    durations: dict[str, list[float]] = {"A": [], "B": []}
    for _ in range(4):
        committed, s = clean_save(oc.other(committed[1]))
        durations[committed[1]].append(s)
    assert classify(path, {"old": states(*committed)}, loaders, rank_commit) == ("old", "")
    duration = {k: max(v) for k, v in durations.items()}

    rng = random.Random(seed)
    slots = list(range(trials))
    rng.shuffle(slots)
    outcomes = {"old": 0, "new": 0, "lost": 0, "mixed": 0}
    finished = 0
    problems: list[str] = []
    t_begin = time.monotonic()
    for trial, slot in enumerate(slots, start=1):
        new = (next(versions), oc.other(committed[1]))
        fraction = 1.1 * (slot + rng.random()) / trials
        pid = server.start(op=op, path=path, version=new[0], layout=new[1], mb=mb)
        server.expect("READY")
        time.sleep(duration[new[1]] * fraction)
        os.kill(pid, signal.SIGKILL)  # not reaped until finish(): the pid cannot be reused
        code, done = server.finish()
        finished += code == 0
        if code not in (0, -signal.SIGKILL):
            problems.append(f"trial {trial}: the save over the directory failed (exit {code}; see stderr)")
        label, detail = classify(path, {"old": states(*committed), "new": states(*new)}, loaders, rank_commit)
        outcomes[label] += 1
        if code == 0 and label != "new":
            problems.append(f"trial {trial}: the save finished but the directory loads as {label}: {detail}")
        elif label in ("lost", "mixed"):
            problems.append(f"trial {trial} (killed at {fraction:.2f} of a save): {label}: {detail}")
        if label == "new":
            committed = new
        elif label != "old":  # nothing to overwrite any more: put a checkpoint back (a save after the kill)
            committed, _ = clean_save("A")
            again = classify(path, {"old": states(*committed)}, loaders, rank_commit)
            if again[0] != "old":
                problems.append(f"trial {trial}: a clean save after the kill does not load: {again}")
    elapsed = time.monotonic() - t_begin
    # a last save: commits, loads, leaves no temp file nor unreferenced shard, keeps the foreign files
    last, _ = clean_save(oc.other(committed[1]))
    assert classify(path, {"new": states(*last)}, loaders, rank_commit) == ("new", "")
    left = leftovers(path, rank_commit)
    report(name, {"trials": trials, "mib": mb, "op": op, "outcomes": outcomes,
                  "saves_finished_before_the_kill": finished,
                  "save_seconds": {k: [round(x, 3) for x in v] for k, v in durations.items()},
                  "delays": "0 to 1.1x the longest measured save of the layout being written",
                  "trial_seconds": round(elapsed, 1), "problems": problems[:20],
                  "leftovers_after_the_last_save": left})
    assert not problems, f"{len(problems)} problems, outcomes {outcomes}:\n" + "\n".join(problems[:15])
    assert sum(outcomes.values()) == trials
    assert not left, f"left after a successful save: {left}"
    assert_foreign_kept(path)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_sigkill_at_random_moments_of_a_dcp_save_over_a_checkpoint(tmp_path, server):
    _kill_trials(tmp_path, server, "dcp", TRIALS, MB, "dcp.save over a checkpoint, timed SIGKILL", 20261203)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sigkill_at_random_moments_of_mmapckpt_save_over_a_checkpoint(tmp_path, server):
    _kill_trials(tmp_path, server, "save", TRIALS_SAVE, MB_SMALL, "mmapckpt.save over a checkpoint, timed SIGKILL",
                 20261204)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sigkill_at_random_moments_of_a_per_rank_commit_save(tmp_path, server):
    """use_collectives=False: the commit is __0.metadata; it must be replaced old-or-new too."""
    _kill_trials(tmp_path, server, "dcp_nocoll", TRIALS_NOCOLL, MB_SMALL,
                 "dcp.save(use_collectives=False) over a checkpoint, timed SIGKILL", 20261205)


# ---------------------------------------------------------------------------- SIGKILL before every call
def _commit_index(events: list[str], commit: str) -> int:
    hits = [i for i, e in enumerate(events) if e.split(":")[0] in ("replace", "rename") and e.endswith("->" + commit)]
    assert len(hits) == 1, f"expected one rename onto {commit}, got {hits} in {events}"
    return hits[0]


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("op", ["dcp", "dcp_nocoll"])
@pytest.mark.parametrize("new_layout", ["B", "A"])
def test_sigkill_before_every_file_system_call_of_a_save_over_a_checkpoint(tmp_path, server, op, new_layout):
    """Killed before the rename of the new commit: the old checkpoint; after it: the new one.
    B over A drops a shard file (3 -> 2): its removal after the commit is hit too."""
    mb, path = 2, str(tmp_path / "ckpt")
    rank_commit = op == "dcp_nocoll"
    loaders = ("dcp",) if rank_commit else LOADERS
    commit = "__0.metadata" if rank_commit else ".metadata"
    old_layout = oc.other(new_layout)
    states = States(mb, objects=True)
    plant_foreign(path)
    versions = itertools.count(1)
    server.run_to_end(op=op, path=path, version=next(versions), layout=new_layout, mb=mb)
    server.run_to_end(op=op, path=path, version=next(versions), layout=old_layout, mb=mb)
    events = server.run_to_end(op=op, path=path, version=next(versions), layout=new_layout, mb=mb)["events"]
    at = _commit_index(events, commit)
    outcomes = {"old": 0, "new": 0, "lost": 0, "mixed": 0}
    problems = []
    for kill_at in range(len(events) + 1):
        old = (next(versions), old_layout)
        server.run_to_end(op=op, path=path, version=old[0], layout=old[1], mb=mb)  # also: a save after a kill
        new = (next(versions), new_layout)
        server.start(op=op, path=path, version=new[0], layout=new[1], mb=mb, kill_at=kill_at)
        code, _ = server.finish()
        if code not in (0, -signal.SIGKILL) or (code == 0 and kill_at < len(events)):
            problems.append(f"kill before call {kill_at}: exit {code}")
        label, detail = classify(path, {"old": states(*old), "new": states(*new)}, loaders, rank_commit)
        outcomes[label] += 1
        want = "old" if kill_at <= at else "new"
        if label != want:
            what = events[kill_at] if kill_at < len(events) else "the end"
            problems.append(f"killed before call {kill_at} ({what}): {label}, expected {want}: {detail}")
    report(f"{op} {old_layout}->{new_layout}, SIGKILL before every file-system call",
           {"calls": len(events), "commit_call": at, "events": events, "outcomes": outcomes})
    assert not problems, f"outcomes {outcomes}:\n" + "\n".join(problems[:15])
    server.run_to_end(op=op, path=path, version=next(versions), layout=old_layout, mb=mb)
    assert not leftovers(path, rank_commit), leftovers(path, rank_commit)
    assert_foreign_kept(path)


# ---------------------------------------------------------------------------- leftovers
@pytest.mark.timeout(300)
def test_leftovers_of_killed_saves_are_removed_by_the_next_save_and_foreign_files_kept(tmp_path, server):
    mb, path = 4, str(tmp_path / "ckpt")
    plant_foreign(path)
    states = States(mb, objects=True)
    server.run_to_end(op="dcp", path=path, version=1, layout="A", mb=mb)
    committed = (1, "A")
    rules = [  # mid shard data; all shards written, just before the commit rename; during the removal after it
        {"name": "pwrite", "match": ".distcp", "nth": 1},
        {"name": "replace", "match": "metadata", "nth": 0},
        {"name": "unlink", "match": "", "nth": 0, "after_commit": True},
    ]
    seen = []
    for v, rule in enumerate(rules, start=2):
        new = (v, oc.other(committed[1]))
        server.start(op="dcp", path=path, version=new[0], layout=new[1], mb=mb, kill_rule=rule)
        code, _ = server.finish()
        label, detail = classify(path, {"old": states(*committed), "new": states(*new)})
        seen.append({"rule": rule, "exit": code, "loads_as": label, "leftovers": leftovers(path)})
        assert label in ("old", "new"), f"killed at {rule}: {label}: {detail}"
        committed = new if label == "new" else committed
    print(json.dumps(seen, indent=1))
    assert seen[0]["exit"] == -signal.SIGKILL and seen[0]["leftovers"], seen[0]  # a torn temp shard is left
    assert any(s["leftovers"] for s in seen[1:]), seen
    final = (9, oc.other(committed[1]))
    server.run_to_end(op="dcp", path=path, version=final[0], layout=final[1], mb=mb)
    assert classify(path, {"new": states(*final)}) == ("new", "")
    assert leftovers(path) == [], f"left after a successful save: {leftovers(path)}; all: {os.listdir(path)}"
    assert_foreign_kept(path)


# ---------------------------------------------------------------------------- ENOSPC and EIO
class Inject:
    """Make writes (pwrite, pwritev, write, writev) or fsyncs on files under ``root`` fail with ``err``.

    ``budget``: bytes that may still be written before every further write fails; ``fsync``: a
    substring of the file name whose fsync fails. Without either it only records the writes.
    """

    def __init__(self, monkeypatch: pytest.MonkeyPatch, root: str, err: int = errno.ENOSPC,
                 budget: int | None = None, fsync: str | None = None) -> None:
        self.root, self.err, self.budget, self.fsync_match = os.path.realpath(root) + os.sep, err, budget, fsync
        self.written, self.fired, self.log = 0, 0, []
        self._lock = threading.Lock()  # the writer's threads write at once: '+=' would lose counts
        self.real = {n: getattr(os, n) for n in ("pwrite", "pwritev", "write", "writev", "fsync", "fdatasync")}
        for n in ("pwrite", "write"):
            monkeypatch.setattr(os, n, self._writer(n, lambda a: len(memoryview(a[1]).cast("B"))))
        for n in ("pwritev", "writev"):
            monkeypatch.setattr(os, n, self._writer(n, lambda a: sum(len(memoryview(b).cast("B")) for b in a[1])))
        for n in ("fsync", "fdatasync"):
            monkeypatch.setattr(os, n, self._sync(n))

    def _name(self, fd: int) -> str | None:
        try:
            p = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            return None
        return os.path.basename(p) if p.startswith(self.root) else None

    def _raise(self) -> None:
        with self._lock:
            self.fired += 1
        raise OSError(self.err, os.strerror(self.err))

    def _writer(self, n: str, size: Callable[[tuple], int]) -> Callable:
        def f(*a: Any) -> Any:
            name = self._name(a[0])
            if name is not None:
                k = size(a)
                with self._lock:  # the budget is checked and spent in one step
                    over = self.budget is not None and self.written + k > self.budget
                    if not over:
                        self.written += k
                        self.log.append((name, k))
                if over:
                    # like the real call, which holds no reference to the buffer once it failed (a
                    # traceback keeping the buffer alive would make the writer's mmap.close() fail)
                    del a
                    self._raise()
            return self.real[n](*a)
        return f

    def _sync(self, n: str) -> Callable:
        def f(fd: int) -> Any:
            name = self._name(fd)
            if name is not None and self.fsync_match is not None and self.fsync_match in name:
                self._raise()
            return self.real[n](fd)
        return f


def _save(api: str, sd: dict[str, Any], path: str, layout: str) -> None:
    if api == "save":
        mmapckpt.save(sd, path, thread_count=oc.THREADS[layout])
    else:
        dcp.save(sd, storage_writer=MmapWriter(path, thread_count=oc.THREADS[layout]), no_dist=True)


def _write_error(call: Callable[[], None]) -> BaseException:
    with pytest.raises(BaseException) as info:
        call()
    err = dcp_failure(info.value)
    assert isinstance(err, CheckpointWriteError), f"{type(err).__name__}: {err}"
    return err


def _failure_case(tmp_path, monkeypatch, api: str, err: int, where: str) -> None:
    mb = 6
    objects = api != "save"
    old, new = oc.make_state(1, "A", mb, objects), oc.make_state(2, "B", mb, objects)
    # a dry run of the same overwrite elsewhere: the bytes each file gets, in order
    probe = str(tmp_path / "probe")
    _save(api, old, probe, "A")
    with monkeypatch.context() as m:
        rec = Inject(m, probe)
        _save(api, new, probe, "B")
    shard_bytes = sum(k for n, k in rec.log if ".distcp" in n)
    before_meta = next(i for i, (n, _) in enumerate(rec.log) if "metadata" in n)
    budget, fsync = {"first write": (0, None), "mid shards": (shard_bytes // 2, None),
                     "metadata": (sum(k for _, k in rec.log[:before_meta]), None),
                     "fsync of a shard": (None, ".distcp"), "fsync of the metadata": (None, "metadata")}[where]
    path = str(tmp_path / "ckpt")
    _save(api, old, path, "A")
    plant_foreign(path)
    with monkeypatch.context() as m:
        inj = Inject(m, path, err, budget, fsync)
        e = _write_error(lambda: _save(api, new, path, "B"))
    assert inj.fired, f"the injected {errno.errorcode[err]} was never hit ({where})"
    assert os.strerror(err) in str(e), str(e)
    del e  # the failed save's writer (and its directory lock) goes with the error's traceback
    gc.collect()  # (test_a_failed_save_does_not_block_a_retry covers a retry while the error lives)
    cands = {"old": old, "new": new}
    assert classify(path, cands) == ("old", ""), f"after {errno.errorcode[err]} at {where}: {classify(path, cands)}"
    newer = oc.make_state(3, "B", mb, objects)
    _save(api, newer, path, "B")
    assert classify(path, {"old": old, "new": newer}) == ("new", "")
    assert leftovers(path) == [], leftovers(path)
    assert_foreign_kept(path)


@pytest.mark.parametrize("where", ["first write", "mid shards", "metadata", "fsync of a shard"])
@pytest.mark.parametrize("api", ["dcp", "save"])
def test_disk_full_keeps_the_old_checkpoint(tmp_path, monkeypatch, api, where):
    _failure_case(tmp_path, monkeypatch, api, errno.ENOSPC, where)


@pytest.mark.parametrize("where", ["mid shards", "fsync of a shard", "fsync of the metadata"])
@pytest.mark.parametrize("api", ["dcp", "save"])
def test_io_error_keeps_the_old_checkpoint(tmp_path, monkeypatch, api, where):
    _failure_case(tmp_path, monkeypatch, api, errno.EIO, where)


@pytest.mark.parametrize("api", ["dcp", "save"])
def test_a_failed_save_does_not_block_a_retry(tmp_path, monkeypatch, api):
    """A retry in the same process, while the first failure is still referenced (inside its except
    block, in a log record, ...), must not find the directory locked by the failed save."""
    mb, objects = 4, api != "save"
    path = str(tmp_path / "ckpt")
    old, new = oc.make_state(1, "A", mb, objects), oc.make_state(2, "B", mb, objects)
    _save(api, old, path, "A")
    with monkeypatch.context() as m:
        Inject(m, path, errno.ENOSPC, budget=0)  # the first write (not the O_DIRECT thread's: a BufferError there)
        try:
            _save(api, new, path, "B")
        except BaseException as e:  # CheckpointException is a BaseException
            failed = e
        else:
            raise AssertionError("the injected ENOSPC did not fail the save")
    assert isinstance(dcp_failure(failed), CheckpointWriteError), dcp_failure(failed)
    _save(api, new, path, "B")  # the retry, `failed` still alive
    assert classify(path, {"old": old, "new": new}) == ("new", "")
    del failed


@pytest.fixture(params=["tmpfs", "ext4"])
def small_fs(request, tmp_path) -> Iterator[str]:
    """A 64 MiB filesystem: tmpfs (buffered writes) or ext4 on a loop device (O_DIRECT writes).
    Needs root and mount rights; skipped where mounting fails."""
    d = str(tmp_path / request.param)
    os.makedirs(d)
    if request.param == "tmpfs":
        argv = ["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", d]
    else:
        img = str(tmp_path / "fs.img")
        with open(img, "wb") as f:
            f.truncate(64 << 20)
        r = subprocess.run(["mkfs.ext4", "-q", "-F", img], capture_output=True, text=True, timeout=60) \
            if shutil.which("mkfs.ext4") else None
        if r is None or r.returncode != 0:
            pytest.skip(f"cannot make an ext4 image: {r.stderr.strip() if r else 'no mkfs.ext4'}")
        argv = ["mount", "-o", "loop", img, d]
    with mounted(argv, d, request.param):
        yield d


@pytest.mark.parametrize("api", ["dcp", "save"])
def test_a_real_full_disk_keeps_the_old_checkpoint(small_fs, api):
    """The old checkpoint (~20 MiB) fits, the new one (~50 MiB) beside it does not."""
    objects = api != "save"
    path = os.path.join(small_fs, "ckpt")
    old, new = oc.make_state(1, "A", 22, objects), oc.make_state(2, "B", 56, objects)
    _save(api, old, path, "A")
    plant_foreign(path)
    e = _write_error(lambda: _save(api, new, path, "B"))
    assert os.strerror(errno.ENOSPC) in str(e), str(e)
    del e
    gc.collect()
    assert classify(path, {"old": old, "new": new}) == ("old", "")
    os.sync()  # ext4 reuses the blocks of the removed temp files only once its journal has committed
    smaller = oc.make_state(3, "B", 12, objects)  # fits beside the old one
    _save(api, smaller, path, "B")
    assert classify(path, {"old": old, "new": smaller}) == ("new", "")
    assert leftovers(path) == [], leftovers(path)
    assert_foreign_kept(path)


# ---------------------------------------------------------------------------- a rank fails or dies
def _spawn_ranks(tmp_path, mode: str, victim: int, world: int = 2) -> tuple[str, list[dict[str, Any]], list[int]]:
    path, out = str(tmp_path / "ckpt"), str(tmp_path / "out")
    os.makedirs(out)
    fd, init_file = tempfile.mkstemp(prefix="mmapckpt-pg-")
    os.close(fd)
    os.unlink(init_file)
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=orr.entry, args=(r, world, init_file, mode, victim, path, out)) for r in range(world)]
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + 240
        for p in procs:
            p.join(max(1.0, deadline - time.monotonic()))
        hung = [i for i, p in enumerate(procs) if p.is_alive()]
        assert not hung, f"ranks {hung} still running after 240 s (a hung collective)"
    finally:
        stop_processes(procs)
        if os.path.exists(init_file):
            os.unlink(init_file)
    results = []
    for r in range(world):
        f = os.path.join(out, f"rank{r}.json")
        results.append(json.load(open(f)) if os.path.exists(f) else {"rank": r, "no result": True})
    for res in results:
        assert "error" not in res, res["error"]
    return path, results, [p.exitcode for p in procs]


@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_a_rank_raising_in_write_data_keeps_the_old_checkpoint(tmp_path):
    path, results, codes = _spawn_ranks(tmp_path, "raise", victim=1)
    assert codes == [0, 0], codes
    for res in results:
        assert res.get("old_saved") and res.get("saved") is False, res
        assert res["outer"] == "CheckpointException" and "injected failure" in res["message"], res
    old, new = orr.full_state(2, 1), orr.full_state(2, 2)
    assert classify(path, {"old": old, "new": new}) == ("old", "")
    newer = orr.full_state(2, 4)  # even like 2: other keys than the old version 1
    dcp.save(newer, storage_writer=MmapWriter(path), no_dist=True)  # the next save (one process) succeeds
    assert classify(path, {"old": old, "new": newer}) == ("new", "")
    assert leftovers(path) == [], leftovers(path)


@pytest.mark.distributed
@pytest.mark.timeout(400)
@pytest.mark.parametrize("victim", [1, 0])
def test_a_rank_killed_in_write_data_keeps_the_old_checkpoint(tmp_path, victim):
    """The victim waits until the other rank wrote its shards, writes part of its own, and is SIGKILLed."""
    path, results, codes = _spawn_ranks(tmp_path, "kill", victim=victim)
    survivor = 1 - victim
    assert codes[victim] == -signal.SIGKILL, codes
    assert results[survivor].get("old_saved") and results[survivor].get("saved") is False, results[survivor]
    assert os.path.exists(str(tmp_path / "out" / f"wrote{survivor}")), "the surviving rank did not finish its writes"
    old, new = orr.full_state(2, 1), orr.full_state(2, 2)
    assert classify(path, {"old": old, "new": new}) == ("old", "")
    newer = orr.full_state(2, 4)  # even like 2: other keys than the old version 1
    dcp.save(newer, storage_writer=MmapWriter(path), no_dist=True)
    assert classify(path, {"old": old, "new": newer}) == ("new", "")
    assert leftovers(path) == [], leftovers(path)


# ---------------------------------------------------------------------------- two writers at once
@pytest.mark.timeout(300)
@pytest.mark.parametrize("block", ["write_data", "finish"])
def test_a_second_writer_is_refused_while_a_save_is_in_progress(tmp_path, server, block):
    mb, path = 2, str(tmp_path / "ckpt")
    go = str(tmp_path / "go")
    states = States(mb, objects=True)
    server.run_to_end(op="dcp", path=path, version=1, layout="A", mb=mb)
    server.start(op="dcp", path=path, version=2, layout="B", mb=mb, block=block, go=go)
    server.expect("READY")
    server.expect("BLOCKED")  # the first save is inside write_data / just before its commit
    try:
        second = oc.make_state(3, "A", mb)
        e = _write_error(lambda: dcp.save(second, storage_writer=MmapWriter(path), no_dist=True))
        assert os.path.abspath(path) in str(e) or path in str(e), str(e)
        e2 = _write_error(lambda: mmapckpt.save(oc.make_state(4, "A", mb, objects=False), path))
        assert path in str(e2) or os.path.abspath(path) in str(e2), str(e2)
        print(f"\nthe second writer got: {e}")
    finally:
        with open(go, "w"):
            pass
        code, done = server.finish()
    assert code == 0 and done is not None, f"the first save failed (exit {code})"
    assert classify(path, {"old": states(1, "A"), "new": states(2, "B")}) == ("new", "")
    assert leftovers(path) == [], leftovers(path)


@pytest.mark.timeout(300)
def test_a_killed_lock_holder_does_not_block_the_next_save(tmp_path, server):
    mb, path = 2, str(tmp_path / "ckpt")
    states = States(mb, objects=True)
    server.run_to_end(op="dcp", path=path, version=1, layout="A", mb=mb)
    pid = server.start(op="dcp", path=path, version=2, layout="B", mb=mb, block="write_data",
                       go=str(tmp_path / "never"))
    server.expect("READY")
    server.expect("BLOCKED")
    os.kill(pid, signal.SIGKILL)
    assert server.finish()[0] == -signal.SIGKILL
    assert classify(path, {"old": states(1, "A"), "new": states(2, "B")}) == ("old", "")
    third = oc.make_state(3, "B", mb)
    dcp.save(third, storage_writer=MmapWriter(path), no_dist=True)
    assert classify(path, {"old": states(1, "A"), "new": third}) == ("new", "")
    fourth = oc.make_state(4, "A", mb, objects=False)
    mmapckpt.save(fourth, path)
    assert classify(path, {"old": third, "new": fourth}) == ("new", "")
    assert leftovers(path) == [], leftovers(path)
