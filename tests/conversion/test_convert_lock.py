"""``convert --overwrite`` and a save into the same directory at the same time.

Each test pauses one of the two in a child process at a chosen point (between its shard write
and its commit, before or after a conversion's swap), synchronised through the child's stdout
(``BLOCKED``) and stdin (``go``), runs the other in this process, then lets the child finish.
The one that finds the directory's lock (storage/lock.py SaveLock) held must fail with a
CheckpointWriteError and leave nothing behind; the other must leave a whole checkpoint, bitwise.
Children are stopped by their pid if a test fails.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import add_foreign, dcp_failure, foreign_kept, tensor_bytes

import mmapckpt
from mmapckpt import CheckpointWriteError, MmapWriter, convert
from mmapckpt.storage import lock as commit
from mmapckpt.tools.cli import main


_CHILD = textwrap.dedent("""
    import importlib, json, os, sys, warnings
    import torch
    import torch.distributed.checkpoint as dcp
    import mmapckpt
    from mmapckpt.tools.cli import main
    warnings.simplefilter("ignore")
    cmd = json.loads(sys.argv[1])
    owner = importlib.import_module(cmd["module"])
    for part in cmd["owner"]:
        owner = getattr(owner, part)
    real = getattr(owner, cmd["name"])

    def paused(*a, **k):  # stop here until the test says go
        print("BLOCKED", flush=True)
        if sys.stdin.readline() != "go\\n":
            os._exit(3)
        return real(*a, **k)

    setattr(owner, cmd["name"], paused)
    g = torch.Generator().manual_seed(cmd["seed"])
    state = {f"layers.{i}.w": torch.randn(4096, generator=g) for i in range(6)}
    try:
        if cmd["op"] == "save":
            mmapckpt.save(state, cmd["dst"])
        elif cmd["op"] == "dcp":
            dcp.save(state, storage_writer=mmapckpt.MmapWriter(cmd["dst"]), no_dist=True)
        else:
            print("EXIT", main(["convert", cmd["src"], cmd["dst"], "--to", cmd["to"], "--overwrite", "-q"]),
                  flush=True)
    except BaseException as e:  # CheckpointException is a BaseException
        print("FAILED", type(e).__name__, e, flush=True)
        sys.exit(1)
    print("DONE", flush=True)
""")

#: where a child pauses: (module, owner attributes, name)
SAVE_BEFORE_COMMIT = ("mmapckpt.dcp.writer", ["MmapWriter"], "finish")  # every shard written, nothing committed
API_SAVE_BEFORE_COMMIT = ("mmapckpt.saving", [], "commit_save")  # mmapckpt.save's: every shard written, no commit
SAVE_BEFORE_WRITE = ("mmapckpt.dcp.writer", ["MmapWriter"], "write_data")  # planned, the lock taken
CONVERT_BEFORE_SWAP = ("mmapckpt.storage.local", ["Swap"], "commit")  # the new checkpoint written beside dst
CONVERT_AFTER_SWAP = ("mmapckpt.storage.replace", [], "_retire")  # dst is the new tree, the old one not yet retired


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layers.{i}.w": torch.randn(4096, generator=g) for i in range(6)}


class Child:
    """A save or conversion in a child process, paused at ``at`` until :meth:`go`."""

    def __init__(self, op: str, at: tuple[str, list[str], str], seed: int, dst: str, src: str = "",
                 to: str = "") -> None:
        cmd = {"op": op, "module": at[0], "owner": at[1], "name": at[2], "seed": seed, "dst": dst, "src": src,
               "to": to}
        self.p = subprocess.Popen([sys.executable, "-c", _CHILD, json.dumps(cmd)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)

    def __enter__(self) -> "Child":
        return self

    def blocked(self) -> None:
        assert self.p.stdout is not None
        line = self.p.stdout.readline().strip()
        assert line == "BLOCKED", f"the child did not reach its pause: {line!r}, exit {self.p.wait()}"

    def go(self) -> tuple[int, str]:
        """Let the child go on; its exit code and its output."""
        out, _ = self.p.communicate("go\n", timeout=300)
        return self.p.returncode, out

    def __exit__(self, *exc: object) -> None:
        if self.p.poll() is None:  # the test failed before letting it finish
            os.kill(self.p.pid, 9)
            self.p.wait()


def holds(path: str, want: dict[str, torch.Tensor]) -> bool:
    got = mmapckpt.load(path)
    return set(got) == set(want) and all(tensor_bytes(got[k]) == tensor_bytes(want[k]) for k in want)


def hidden_siblings(path: str) -> list[str]:
    parent, base = os.path.split(os.path.abspath(path))
    return sorted(n for n in os.listdir(parent) if n.startswith(f".{base}."))


def _setup(tmp_path) -> tuple[str, str]:
    """dst: a checkpoint (seed 1) with files of other names; src: another checkpoint (seed 2)."""
    dst, src = str(tmp_path / "dst"), str(tmp_path / "src")
    mmapckpt.save(_state(1), dst)
    add_foreign(dst)
    mmapckpt.save(_state(2), src)
    return dst, src


def _convert_api(src: str, dst: str, to: str) -> None:
    opts = {"max_shard_size": 40_000} if to == "hf" else {}
    convert(src, dst, to="safetensors" if to == "hf" else to, overwrite=True, **opts)


def _convert_cli(src: str, dst: str, to: str, capsys) -> None:
    argv = ["convert", src, dst, "--overwrite", "-q", "--to", "safetensors" if to == "hf" else to]
    code = main(argv + (["--max-shard-size", "40000"] if to == "hf" else []))
    err = capsys.readouterr().err
    if code != 0:
        raise CheckpointWriteError(err)  # as the API raised it: the message is what the user sees


# --------------------------------------------------------------------------- a save in progress, then a convert
@pytest.mark.timeout(300)
@pytest.mark.parametrize("op, at, how, to", [
    ("save", API_SAVE_BEFORE_COMMIT, "api", "mmapckpt"),
    ("dcp", SAVE_BEFORE_COMMIT, "api", "dcp"),
    ("save", API_SAVE_BEFORE_COMMIT, "api", "hf"),
    ("dcp", SAVE_BEFORE_WRITE, "api", "mmapckpt"),
    ("save", API_SAVE_BEFORE_COMMIT, "cli", "mmapckpt"),
], ids=["save-before-commit", "dcp.save-before-commit", "save-before-commit-to-hf", "dcp.save-before-write",
        "save-before-commit-cli"])
def test_a_convert_while_a_save_is_in_progress_is_refused_and_the_save_commits(tmp_path, capsys, op, at, how, to):
    dst, src = _setup(tmp_path)
    with Child(op, at, 3, dst) as child:
        child.blocked()
        before = sorted(os.listdir(dst))
        with pytest.raises(CheckpointWriteError, match="in progress") as info:
            (_convert_api(src, dst, to) if how == "api" else _convert_cli(src, dst, to, capsys))
        assert dst in str(info.value)
        assert sorted(os.listdir(dst)) == before, "the refused conversion changed the directory"
        assert hidden_siblings(dst) == [], "the refused conversion left files beside the directory"
        code, out = child.go()
    assert code == 0 and "DONE" in out, out
    assert holds(dst, _state(3)), "the save's checkpoint is not whole"
    assert foreign_kept(dst)
    _convert_api(src, dst, "mmapckpt")  # the lock is free again
    assert holds(dst, _state(2)) and foreign_kept(dst)


# --------------------------------------------------------------------------- a convert in progress, then a save
def _save(op: str, path: str, seed: int) -> None:
    if op == "save":
        mmapckpt.save(_state(seed), path)
    else:
        dcp.save(_state(seed), storage_writer=MmapWriter(path), no_dist=True)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("at", [CONVERT_BEFORE_SWAP, CONVERT_AFTER_SWAP], ids=["before-swap", "after-swap"])
@pytest.mark.parametrize("to", ["mmapckpt", "dcp"])
def test_a_save_while_a_convert_is_in_progress_is_refused_and_the_convert_commits(tmp_path, at, to):
    dst, src = _setup(tmp_path)
    with Child("convert", at, 0, dst, src, to) as child:
        child.blocked()
        before = sorted(os.listdir(dst))
        for op in ("save", "dcp"):
            with pytest.raises(BaseException) as info:
                _save(op, dst, 3)
            err = dcp_failure(info.value)
            assert isinstance(err, CheckpointWriteError) and "in progress" in str(err), f"{op}: {err!r}"
            del info, err
        assert sorted(os.listdir(dst)) == before, "the refused save changed the directory"
        code, out = child.go()
    assert code == 0 and "EXIT 0" in out, out
    assert holds(dst, _state(2)), "the conversion's checkpoint is not whole"
    assert foreign_kept(dst) and hidden_siblings(dst) == []
    _save("save", dst, 4)  # the lock is free again
    assert holds(dst, _state(4)) and foreign_kept(dst)


# --------------------------------------------------------------------------- the lock follows the path
def test_the_save_lock_locks_the_directory_the_path_names_after_a_swap(tmp_path, monkeypatch) -> None:
    """A directory swapped in between the lock's open and its flock (a conversion's exchange) is the one locked."""
    path, other, aside = str(tmp_path / "ckpt"), str(tmp_path / "other"), str(tmp_path / "aside")
    os.makedirs(path), os.makedirs(other)
    real = commit.fcntl.flock
    swapped = []

    def flock(fd: int, op: int) -> None:
        if not swapped:
            swapped.append(True)
            os.rename(path, aside)  # the directory opened is moved away, another one put in its place
            os.rename(other, path)
        real(fd, op)

    monkeypatch.setattr(commit.fcntl, "flock", flock)
    lock = commit.SaveLock(path)
    monkeypatch.setattr(commit.fcntl, "flock", real)
    assert swapped
    with pytest.raises(CheckpointWriteError, match="in progress"):
        commit.SaveLock(path)  # the directory now at the path is the locked one
    commit.SaveLock(aside).release()  # the one moved away is not held
    lock.release()
    commit.SaveLock(path).release()


@pytest.mark.timeout(300)
def test_a_convert_through_a_link_takes_the_lock_of_the_linked_directory(tmp_path):
    dst, src = _setup(tmp_path)
    link = str(tmp_path / "latest")
    os.symlink("dst", link)
    with Child("save", API_SAVE_BEFORE_COMMIT, 3, dst) as child:
        child.blocked()
        with pytest.raises(CheckpointWriteError, match="in progress"):
            _convert_api(src, link, "mmapckpt")
        assert hidden_siblings(dst) == [] and hidden_siblings(link) == []
        code, out = child.go()
    assert code == 0 and "DONE" in out, out
    assert holds(link, _state(3)) and os.path.islink(link)
