"""Concurrent use: many readers at once, readers next to writers, async saves.

* 8 processes and 8 threads loading one checkpoint at the same moment (a barrier)
  all get bitwise-correct results;
* a reader of checkpoint A loads correct data while a writer saves B next to it;
* a reader of A while a writer replaces A again and again (overwrite=True, two shard
  files): every load returns one complete version bit for bit or raises a
  CheckpointError, never a mix and never SIGBUS (the reader runs in a child so a
  signal would show in its exit status); one interleaving is also forced
  deterministically (the save runs between reading the metadata and reading data);
* dcp.async_save with MmapWriter: saves in sequence complete and load back, and no
  staged buffer outlives its save (weakrefs).
"""

from __future__ import annotations

import gc
import hashlib
import json
import logging
import multiprocessing as mp
import os
import subprocess
import sys
import threading
import weakref
from typing import Any

import pytest
import torch

from helpers import assert_tree_equal, dcp_failure, dcp_load, dcp_save, stop_processes, tensor_bytes
from test_crash import make_state

import mmapckpt
from mmapckpt import CheckpointError, IncompleteCheckpointError, MmapReader, MmapWriter

TESTS = os.path.dirname(os.path.abspath(__file__))
#: tests/, where helpers.py and strategies.py live (subprocesses put both on sys.path)
TESTS_ROOT = os.path.dirname(TESTS)
MB = 8
N_PROCS = 8
N_THREADS = 8


def _targets(mb: int = MB) -> dict[str, Any]:
    return {k: (torch.empty_like(v) if isinstance(v, torch.Tensor) else {"step": -1, "note": ""})
            for k, v in make_state(0, mb).items()}


def _digest(sd: dict[str, Any]) -> dict[str, str]:
    return {k: hashlib.sha256(tensor_bytes(v)).hexdigest() if isinstance(v, torch.Tensor) else repr(v)
            for k, v in sorted(sd.items())}


# --------------------------------------------------------------------------- many readers
def _proc_reader(path: str, barrier: Any, out: Any) -> None:
    import warnings

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    t = _targets()
    barrier.wait(timeout=300)
    dcp_load(t, MmapReader(path))
    out.put(_digest(t))


@pytest.mark.slow
def test_eight_processes_load_the_same_checkpoint_at_once(tmp_path):
    path = str(tmp_path / "A")
    dcp_save(make_state(3, MB), MmapWriter(path, thread_count=2))
    want = _digest(make_state(3, MB))
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(N_PROCS), ctx.Queue()
    procs = [ctx.Process(target=_proc_reader, args=(path, barrier, out)) for _ in range(N_PROCS)]
    try:
        for p in procs:
            p.start()
        results = [out.get(timeout=600) for _ in procs]
        for p in procs:
            p.join(timeout=120)
    finally:
        stop_processes(procs)
    assert [p.exitcode for p in procs] == [0] * N_PROCS
    assert all(r == want for r in results), "a concurrent reader process got different bytes"


def test_eight_threads_load_the_same_checkpoint_at_once(tmp_path):
    path = str(tmp_path / "A")
    dcp_save(make_state(4, MB), MmapWriter(path, thread_count=2))
    want = make_state(4, MB)
    barrier = threading.Barrier(N_THREADS)
    results: list[Any] = [None] * N_THREADS

    def run(i: int) -> None:
        try:
            barrier.wait(timeout=120)
            if i % 2:
                results[i] = dcp_load(_targets(), MmapReader(path, thread_count=2, verify=True))
            else:
                results[i] = mmapckpt.load(path)
        except BaseException as e:  # report in the main thread
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(N_THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    for i, r in enumerate(results):
        assert not isinstance(r, BaseException), f"thread {i}: {r!r}"
        if i % 2:
            assert_tree_equal(r, want, f"thread {i}")
        else:  # mmapckpt.load gives a flat {fqn: value} dict
            for k, v in want.items():
                if isinstance(v, torch.Tensor):
                    assert tensor_bytes(r[k]) == tensor_bytes(v), f"thread {i}: {k}"


# --------------------------------------------------------------------------- readers next to writers
_WRITER = r"""
import sys, warnings, torch
warnings.simplefilter("ignore")
torch.set_num_threads(1)
sys.path[:0] = [sys.argv[1], __import__('os').path.dirname(sys.argv[1])]
from test_crash import make_state
from helpers import dcp_save
from mmapckpt import MmapWriter
path, first, count, mb = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
for v in range(first, first + count):
    dcp_save(make_state(v, mb), MmapWriter(path, thread_count=2, overwrite=True))
print("WROTE", count, flush=True)
"""


def _start_writer(path: str, first: int, count: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", _WRITER, TESTS, path, str(first), str(count), str(MB)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def reader_loop(path: str, versions: list[int], writer_pid: int) -> None:
    """In a child: load ``path`` until the writer exits; classify every load; print JSON counts."""
    import warnings

    warnings.simplefilter("ignore")
    logging.disable(logging.CRITICAL)
    torch.set_num_threads(1)
    expected = {v: _digest(make_state(v, MB)) for v in versions}
    counts: dict[str, int] = {}

    def alive() -> bool:
        try:
            os.kill(writer_pid, 0)
        except ProcessLookupError:
            return False
        with open(f"/proc/{writer_pid}/stat") as f:  # a zombie has exited
            return f.read().split(")")[-1].split()[0] != "Z"

    while True:
        running = alive()
        t = _targets()
        try:
            MmapReader(path).read_metadata()
            dcp_load(t, MmapReader(path, thread_count=2))
        except BaseException as e:
            err = dcp_failure(e)
            assert isinstance(err, CheckpointError), f"{type(err).__name__}: {err}"
            key = "refused:" + type(err).__name__
        else:
            v = int(t["version"].item())
            assert v in expected and _digest(t) == expected[v], f"load returned a mix (version tensor says {v})"
            key = "loaded a complete version"
        counts[key] = counts.get(key, 0) + 1
        if not running:
            break
    print(json.dumps(counts), flush=True)


def _run_reader(path: str, versions: list[int], writer: subprocess.Popen) -> dict[str, int]:
    code = f"import sys; sys.path[:0] = [{TESTS!r}, {TESTS_ROOT!r}]; import test_concurrency as t; " \
           f"t.reader_loop(sys.argv[1], {versions!r}, {writer.pid})"
    try:
        r = subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True, timeout=600)
        out, err = writer.communicate(timeout=600)
    finally:
        stop_processes([writer])
    assert writer.returncode == 0 and "WROTE" in out, err[-3000:]
    assert r.returncode == 0, f"reader exit {r.returncode} (-7 is SIGBUS)\n{r.stderr[-4000:]}"
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_reader_of_a_is_undisturbed_by_a_writer_of_b(tmp_path):
    a, b = str(tmp_path / "A"), str(tmp_path / "B")
    dcp_save(make_state(1, MB), MmapWriter(a, thread_count=2))
    writer = _start_writer(b, 10, 6)
    counts = _run_reader(a, [1], writer)
    print(f"\nreader of A next to a writer of B: {counts}")
    assert set(counts) == {"loaded a complete version"}, counts


@pytest.mark.slow
def test_reader_of_a_while_a_is_replaced(tmp_path):
    a = str(tmp_path / "A")
    dcp_save(make_state(1, MB), MmapWriter(a, thread_count=2))
    writer = _start_writer(a, 2, 8)
    counts = _run_reader(a, list(range(1, 10)), writer)
    print(f"\nreader of A while A is replaced 8 times: {counts}")
    assert sum(counts.values()) >= 1
    assert set(counts) <= {"loaded a complete version", "refused:IncompleteCheckpointError",
                           "refused:CheckpointError"}, counts


class _SaveBetweenMetadataAndData(MmapReader):
    """A reader that lets another save replace the checkpoint right after reading its metadata."""

    def __init__(self, path: str, save: Any) -> None:
        super().__init__(path)
        self._save = save

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        md = super().read_metadata(*args, **kwargs)
        self._save()
        return md


@pytest.mark.parametrize("threads", [1, 2])
def test_replacing_a_checkpoint_between_metadata_and_data_is_detected(tmp_path, threads):
    path = str(tmp_path / "A")
    dcp_save(make_state(1, 1), MmapWriter(path, thread_count=threads))
    # same shapes, so every offset and length of the new save equals the old one's
    reader = _SaveBetweenMetadataAndData(path, lambda: dcp_save(make_state(2, 1), MmapWriter(path, thread_count=threads)))
    with pytest.raises(BaseException) as info:
        dcp_load(_targets(1), reader)
    err = dcp_failure(info.value)
    assert isinstance(err, IncompleteCheckpointError) and "replaced while it was being loaded" in str(err), err
    assert_tree_equal(dcp_load(_targets(1), MmapReader(path)), make_state(2, 1))


def test_open_checkpoint_replaced_underneath_gives_old_data_or_an_error(tmp_path):
    path = str(tmp_path / "A")
    dcp_save(make_state(1, 1), MmapWriter(path, thread_count=2))
    old = make_state(1, 1)
    with mmapckpt.open(path) as ck:
        first = ck.get_tensor("layer0.weight")
        dcp_save(make_state(2, 1), MmapWriter(path, thread_count=2))
        assert tensor_bytes(first) == tensor_bytes(old["layer0.weight"])  # mapped before: still the old bytes
        for k in ("layer1.weight", "layer6.int", "version"):
            try:
                got = ck.get_tensor(k)
            except CheckpointError:
                continue
            assert tensor_bytes(got) == tensor_bytes(old[k]), f"{k}: new bytes through the old metadata"


# --------------------------------------------------------------------------- async_save
def test_async_saves_in_sequence_complete_and_load_back(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    futures, writers, staged_refs = [], [], []
    for v in range(4):
        path = str(tmp_path / f"s{v % 2}")  # two directories, each overwritten after its previous save
        if v >= 2:
            futures[v - 2].result()  # one directory is written by one save at a time
        planner, writer = DefaultSavePlanner(), MmapWriter(path, thread_count=2)
        fut = dcp.async_save(make_state(v, 2), storage_writer=writer, planner=planner, no_dist=True)
        futures.append(fut)
        writers.append(writer)
        staged_refs.append((planner, fut))
    for f in futures:
        f.result(timeout=300)
    for v in (2, 3):
        assert_tree_equal(dcp_load(_targets(2), MmapReader(str(tmp_path / f"s{v % 2}"), verify=True)),
                          make_state(v, 2), f"async save {v}")
    # the planner holds the staged state dict; once it and the future are gone, nothing may keep it alive
    refs = []
    for planner, _ in staged_refs:
        staged = planner.state_dict
        refs += [weakref.ref(t) for t in staged.values() if isinstance(t, torch.Tensor)]
    assert len(refs) >= 4 * 10
    del staged, planner, staged_refs, futures, fut
    gc.collect()
    alive = [r for r in refs if r() is not None]
    assert not alive, f"{len(alive)} staged tensors outlive their saves (writers kept: {len(writers)})"
