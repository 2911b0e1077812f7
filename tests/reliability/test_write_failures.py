"""Failures while writing: dcp.save raises a clear CheckpointWriteError and leaves nothing that looks complete.

* a file-size limit (RLIMIT_FSIZE) in a child process: writes past it fail with EFBIG
  (CPython starts with SIGXFSZ ignored); with the default SIGXFSZ action the kernel
  kills the process instead, which must leave the same refused, incomplete directory;
* permission denied: the test runs as root, which chmod does not stop, so a child
  drops to uid/gid 65534 (nobody) after importing torch and saves into directories
  owned by root;
* a regular file where the checkpoint directory (or a parent of it) should be;
* the metadata commit failing after every shard was written.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from typing import Any

import pytest
import torch

from helpers import assert_tree_equal, dcp_failure, dcp_load, dcp_save

from mmapckpt import (
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointWriteError,
    IncompleteCheckpointError,
    MmapReader,
    MmapWriter,
)

TESTS = os.path.dirname(os.path.abspath(__file__))
#: tests/, where helpers.py and strategies.py live (subprocesses put both on sys.path)
TESTS_ROOT = os.path.dirname(TESTS)


def _state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(512, 1024, generator=g), "b": torch.randn(256, 1024, generator=g).to(torch.bfloat16),
            "c": torch.arange(1000, dtype=torch.int64) * seed, "meta": {"seed": seed}}


def _empty_like(sd: dict[str, Any]) -> dict[str, Any]:
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else {"seed": -1} for k, v in sd.items()}


def _refused(path: str) -> type[CheckpointError]:
    """The error type a reader gives for ``path``; fails if the checkpoint loads."""
    with pytest.raises((IncompleteCheckpointError, CheckpointNotFoundError)) as info:
        MmapReader(path).read_metadata()
    return type(info.value)


def _no_temp_files(path: str) -> None:
    if os.path.isdir(path):
        left = [n for n in os.listdir(path) if ".tmp-" in n]
        assert not left, f"temporary files left behind: {left}"


def _run_child(code: str, *args: str) -> dict[str, Any]:
    prog = f"import sys; sys.path[:0] = [{TESTS!r}, {TESTS_ROOT!r}]; import test_write_failures as t; {code}"
    r = subprocess.run([sys.executable, "-c", prog, *args], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def _save_outcome(sd: dict[str, Any], path: str, **kw: Any) -> dict[str, Any]:
    """dcp.save; describe the error that arrives (type of the unwrapped failure, message)."""
    import torch.distributed.checkpoint as dcp

    try:
        dcp.save(sd, storage_writer=MmapWriter(path, **kw), no_dist=True)
    except BaseException as e:  # CheckpointException is a BaseException
        err = dcp_failure(e)
        return {"ok": False, "outer": type(e).__name__, "type": type(err).__name__,
                "is_write_error": isinstance(err, CheckpointWriteError), "message": str(err)}
    return {"ok": True}


# --------------------------------------------------------------------------- RLIMIT_FSIZE
def fsize_child(root: str) -> None:
    """In a child: save a 3 MiB checkpoint, then limit file sizes to 1 MiB and save again (3 cases)."""
    import resource
    import warnings

    warnings.simplefilter("ignore")
    out: dict[str, Any] = {"sigxfsz_ignored": signal.getsignal(signal.SIGXFSZ) == signal.SIG_IGN}
    dcp_save(_state(1), MmapWriter(os.path.join(root, "over")))  # committed before the limit
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
    out["fresh"] = _save_outcome(_state(2), os.path.join(root, "fresh"))
    out["over"] = _save_outcome(_state(2), os.path.join(root, "over"))
    out["threads"] = _save_outcome(_state(2), os.path.join(root, "threads"), thread_count=3)
    print(json.dumps(out))


def test_file_size_limit_raises_write_error(tmp_path):
    root = str(tmp_path)
    out = _run_child("t.fsize_child(sys.argv[1])", root)
    assert out["sigxfsz_ignored"], "CPython is expected to start with SIGXFSZ ignored"
    for case in ("fresh", "over", "threads"):
        o = out[case]
        assert not o["ok"], f"{case}: a save past RLIMIT_FSIZE succeeded"
        assert o["outer"] == "CheckpointException" and o["is_write_error"], o
        assert "File too large" in o["message"] and ".distcp" in o["message"], o
        _no_temp_files(os.path.join(root, case))
    assert _refused(os.path.join(root, "fresh")) in (CheckpointNotFoundError, IncompleteCheckpointError)
    # the overwritten checkpoint's commit stays until the new one replaces it: it still loads, bitwise
    assert_tree_equal(dcp_load(_empty_like(_state(1)), MmapReader(os.path.join(root, "over"))), _state(1))
    assert _refused(os.path.join(root, "threads")) in (CheckpointNotFoundError, IncompleteCheckpointError)


def sigxfsz_default_child(root: str) -> None:
    """The default action of SIGXFSZ kills the process (core dump): a crash, not an exception."""
    import resource

    dcp_save(_state(1), MmapWriter(root))
    signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
    dcp_save(_state(2), MmapWriter(root))
    print(json.dumps({"survived": True}))


def test_file_size_limit_with_default_sigxfsz_kills_but_leaves_the_old_checkpoint(tmp_path):
    root = str(tmp_path / "ckpt")
    prog = f"import sys; sys.path[:0] = [{TESTS!r}, {TESTS_ROOT!r}]; import test_write_failures as t; t.sigxfsz_default_child(sys.argv[1])"
    r = subprocess.run([sys.executable, "-c", prog, root], capture_output=True, text=True, timeout=300)
    assert r.returncode == -signal.SIGXFSZ, (r.returncode, r.stderr[-3000:])
    # killed mid-shard: the checkpoint it was replacing is still the one committed, bit for bit
    assert_tree_equal(dcp_load(_empty_like(_state(1)), MmapReader(root)), _state(1))
    assert any(".tmp-" in n for n in os.listdir(root)), "the kill left the shard it was writing"
    dcp_save(_state(2), MmapWriter(root))  # the next save commits and removes that leftover
    _no_temp_files(root)
    assert_tree_equal(dcp_load(_empty_like(_state(2)), MmapReader(root)), _state(2))


# --------------------------------------------------------------------------- permission denied
def nobody_child(root: str) -> None:
    """Import and warm up everything as root, then drop to nobody and save into root-owned directories."""
    import warnings

    warnings.simplefilter("ignore")
    scratch = tempfile.mkdtemp()
    dcp_save(_state(3), MmapWriter(scratch))  # load every lazily imported module while still root
    dcp_load(_empty_like(_state(3)), MmapReader(scratch))
    _save_outcome(_state(3), os.path.join(scratch, "x", "y"))
    try:
        _save_outcome(_state(3), os.path.join(scratch, ".metadata", "z"))
    finally:
        shutil.rmtree(scratch)
    os.setgroups([])
    os.setresgid(65534, 65534, 65534)
    os.setresuid(65534, 65534, 65534)
    out = {"uid": os.getuid(),
           "over": _save_outcome(_state(4), os.path.join(root, "existing")),
           "new_dir": _save_outcome(_state(4), os.path.join(root, "new")),
           "new_parent": _save_outcome(_state(4), os.path.join(root, "a", "b"))}
    print(json.dumps(out))


def test_permission_denied_raises_write_error_and_keeps_the_old_checkpoint():
    if os.getuid() != 0:
        pytest.skip("written for root (chmod does not stop root); as another user a read-only directory "
                    "is tested by making one with chmod")
    root = tempfile.mkdtemp(prefix="mmapckpt-ro-", dir="/tmp")  # /tmp/pytest-of-root is 0700: nobody cannot enter
    try:
        os.chmod(root, 0o755)
        existing = os.path.join(root, "existing")
        dcp_save(_state(1), MmapWriter(existing))
        before = sorted(os.listdir(existing))
        out = _run_child("t.nobody_child(sys.argv[1])", root)
        assert out["uid"] == 65534
        for case in ("over", "new_dir", "new_parent"):
            o = out[case]
            assert not o["ok"] and o["is_write_error"], (case, o)
            assert "Permission denied" in o["message"], o
        assert "writing shard failed" in out["over"]["message"]
        assert "checkpoint directory" in out["new_dir"]["message"]
        # the old checkpoint was left untouched and still loads bit for bit
        assert sorted(os.listdir(existing)) == before
        assert_tree_equal(dcp_load(_empty_like(_state(1)), MmapReader(existing)), _state(1))
        assert not os.path.exists(os.path.join(root, "new")) and not os.path.exists(os.path.join(root, "a"))
    finally:
        shutil.rmtree(root)


# --------------------------------------------------------------------------- file where a directory should be
@pytest.mark.parametrize("sub", ["", "child"])
def test_regular_file_in_place_of_the_directory(tmp_path, sub):
    f = tmp_path / "not_a_dir"
    f.write_bytes(b"user data")
    path = str(f / sub) if sub else str(f)
    o = _save_outcome(_state(5), path)
    assert not o["ok"] and o["is_write_error"], o
    assert "cannot create the checkpoint directory" in o["message"] and str(f) in o["message"], o
    assert f.read_bytes() == b"user data"


# --------------------------------------------------------------------------- the metadata commit fails
def test_failed_metadata_commit_leaves_the_old_checkpoint(tmp_path):
    path = str(tmp_path / "ckpt")
    dcp_save(_state(6), MmapWriter(path))
    # the commit writes .metadata through ".<name>.tmp-<pid>": a directory of that name makes it fail
    blocker = os.path.join(path, f"..metadata.tmp-{os.getpid()}")
    os.mkdir(blocker)
    o = _save_outcome(_state(7), path)
    assert not o["ok"] and o["is_write_error"], o
    assert "committing the metadata failed" in o["message"], o
    assert_tree_equal(dcp_load(_empty_like(_state(6)), MmapReader(path)), _state(6))  # old, bit for bit
    shards = [n for n in os.listdir(path) if n.endswith(".distcp")]
    assert len(shards) == 2, f"the new shard was written beside the old one before the commit failed: {shards}"
    os.rmdir(blocker)
    # the next save over the incomplete directory commits and loads
    dcp_save(_state(8), MmapWriter(path))
    assert_tree_equal(dcp_load(_empty_like(_state(8)), MmapReader(path)), _state(8))
    assert len([n for n in os.listdir(path) if n.endswith(".distcp")]) == 1, "the uncommitted shard was removed"
