"""The ranks of helpers.run_distributed leave no process group running into interpreter exit.

A gloo group that outlives its rank's shutdown keeps its worker threads into interpreter exit;
one that drops its last finished Work (whose tensors own Python objects) after finalization
began is ended by Python with pthread_exit, and the unwinding through the Work's destructor
aborts the rank ("terminate called without an active exception", SIGABRT: how
test_stock_parity_dist.py failed now and then). These ranks hold their groups the ways that
happened there and in test_distributed_dcp.py: a DeviceMesh reachable only from an exception's
traceback (a garbage cycle), and meshes kept by DTensor's caches after DTensor ops; each rank
records, from an atexit hook, the threads still alive when the interpreter starts to exit. A
group still referred to after the shutdown fails the rank instead of aborting it at random.
"""

from __future__ import annotations

import atexit
import json
import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

import helpers

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240),
              pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads thread names from /proc")]

#: the names of a gloo group's threads (ProcessGroupGloo's workers, gloo's TCP event loop)
GLOO_THREADS = {"pt_gloo_runloop", "gloo_tcp_loop"}


def _thread_names() -> list[str]:
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # the thread ended meanwhile
            pass
    return sorted(names)


def _record_threads_at_exit(out: str, rank: int) -> None:
    with open(os.path.join(out, f"exit{rank}.json"), "w") as f:
        json.dump(_thread_names(), f)


def _raise_with_a_mesh(world: int) -> None:
    mesh = init_device_mesh("cpu", (world,))  # noqa: F841  (held by the frame the traceback keeps)
    raise ValueError("caught by the caller, whose kept traceback keeps this frame")


def _hold_groups(rank: int, world: int, out: str) -> None:
    atexit.register(_record_threads_at_exit, out, rank)
    dist.barrier()  # run by a worker thread, which names itself first
    assert "pt_gloo_runloop" in _thread_names(), _thread_names()  # what the check at exit looks for
    kept = []
    try:
        _raise_with_a_mesh(world)
    except ValueError as e:
        kept.append(e)  # a cycle: the exception, its traceback, this frame, kept
    d = distribute_tensor(torch.arange(8.0), init_device_mesh("cpu", (world,)), [Shard(0)])
    assert float((d + 1).sum().full_tensor()) == 36.0  # cached: sharding propagation, redistribution plan


def test_no_gloo_thread_is_alive_at_interpreter_exit(tmp_path: Any) -> None:
    helpers.run_distributed(_hold_groups, 2, str(tmp_path))
    for rank in range(2):
        with open(tmp_path / f"exit{rank}.json") as f:
            names = json.load(f)
        assert not GLOO_THREADS & set(names), f"rank {rank} exits with {names}"


_KEPT: list[Any] = []


def _keep_a_group(rank: int, world: int) -> None:
    _KEPT.append(dist.new_group([0, 1]))


def test_a_group_kept_beyond_the_rank_function_fails_the_rank() -> None:
    with pytest.raises(Exception, match="still referred to after destroy_process_group"):
        helpers.run_distributed(_keep_a_group, 2)


def _fail(rank: int, world: int) -> None:
    mesh = init_device_mesh("cpu", (world,))  # noqa: F841
    raise KeyError(f"rank {rank} fails")


def test_a_failing_rank_reports_its_own_traceback() -> None:
    with pytest.raises(Exception, match=r"RankFailed: Traceback[\s\S]*KeyError: 'rank \d fails'") as info:
        helpers.run_distributed(_fail, 2)
    assert "still referred to" not in str(info.value)  # its traceback was dropped before the shutdown
