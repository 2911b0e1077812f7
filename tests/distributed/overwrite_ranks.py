"""Rank side of the multi-rank overwrite tests (tests/reliability/test_overwrite.py).

Each spawned rank joins a 2-rank gloo group, saves the old checkpoint with ``MmapWriter``
(both ranks write a shard), then saves a new version of another layout over it with
``FaultyWriter``, which on the victim rank either raises in ``write_data`` or SIGKILLs its
process after the other rank finished its writes and after writing part of its own shard.
Every surviving rank records what its ``dcp.save`` did in ``out_dir/rank{r}.json`` and leaves
with ``os._exit`` (a dead peer could hang ``destroy_process_group``).
"""

from __future__ import annotations

import json
import os
import signal
import time
import traceback
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from mmapckpt import MmapWriter


def rank_state(rank: int, version: int) -> dict[str, Any]:
    """Rank ``rank``'s state dict of ``version``: a replicated tensor, tensors only this rank holds;
    shapes and dtypes depend on the version, so two versions have different layouts."""
    g = torch.Generator().manual_seed(1000 * version)
    sd: dict[str, Any] = {"shared.weight": torch.randn(128 + 16 * version, 64, generator=g),
                          "version": torch.tensor([version], dtype=torch.int64)}
    gr = torch.Generator().manual_seed(1000 * version + 1 + rank)
    sd[f"rank{rank}.weight"] = torch.randn(256 + 64 * version, 96, generator=gr).to(
        torch.bfloat16 if version % 2 else torch.float16)
    sd[f"rank{rank}.ids"] = torch.randint(-2**31, 2**31 - 1, (1000 + version, 2), generator=gr, dtype=torch.int32)
    if version % 2 == 0:
        sd[f"rank{rank}.extra"] = torch.randn(33, 17, generator=gr, dtype=torch.float64)
    return sd


def full_state(world: int, version: int) -> dict[str, Any]:
    """What a single-process load of the whole checkpoint must return."""
    out: dict[str, Any] = {}
    for r in range(world):
        out.update(rank_state(r, version))
    return out


def _touch(path: str) -> None:
    with open(path, "w") as f:
        f.write("x")


class FaultyWriter(MmapWriter):
    """MmapWriter whose write_data fails on ``victim``: ``mode`` "raise" or "kill"."""

    def __init__(self, path: str, *, mode: str, victim: int, out_dir: str, **kw: Any) -> None:
        super().__init__(path, **kw)
        self.mode, self.victim, self.out_dir = mode, victim, out_dir

    def write_data(self, plan: Any, planner: Any) -> Any:
        rank = dist.get_rank()
        if rank != self.victim:
            fut = super().write_data(plan, planner)
            fut.wait()
            _touch(os.path.join(self.out_dir, f"wrote{rank}"))
            return fut
        if self.mode == "raise":
            raise RuntimeError(f"injected failure in write_data on rank {rank}")
        # kill: wait until every other rank has written its shards, write part of ours, die
        deadline = time.monotonic() + 60
        others = [r for r in range(dist.get_world_size()) if r != rank]
        while not all(os.path.exists(os.path.join(self.out_dir, f"wrote{r}")) for r in others):
            if time.monotonic() > deadline:
                break
            time.sleep(0.01)
        real = os.pwrite
        calls = [0]

        def pwrite(fd: int, data: Any, off: int) -> int:
            calls[0] += 1
            mv = memoryview(data).cast("B")
            if len(mv) > 4096 or calls[0] > 1:  # not the O_DIRECT probe: a data write
                real(fd, mv[: max(4096, (len(mv) // 2) & ~4095)], off)
                os.kill(os.getpid(), signal.SIGKILL)
            return real(fd, data, off)

        os.pwrite = pwrite  # type: ignore[assignment]
        try:
            super().write_data(plan, planner)
        finally:
            os.kill(os.getpid(), signal.SIGKILL)  # whatever was written: die before returning
        raise AssertionError("unreachable")


def entry(rank: int, world: int, init_file: str, mode: str, victim: int, path: str, out_dir: str) -> None:
    result: dict[str, Any] = {"rank": rank}
    try:
        import warnings

        warnings.simplefilter("ignore")
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=30))
        dcp.save(rank_state(rank, 1), storage_writer=MmapWriter(path))  # the old checkpoint
        dist.barrier()
        result["old_saved"] = True
        writer = FaultyWriter(path, mode=mode, victim=victim, out_dir=out_dir)
        try:
            dcp.save(rank_state(rank, 2), storage_writer=writer)
            result["saved"] = True
        except BaseException as e:  # CheckpointException is a BaseException
            failures = getattr(e, "failures", None) or {}
            result.update(saved=False, outer=type(e).__name__, message=str(e)[:2000],
                          failures={str(r): repr(f[0] if isinstance(f, tuple) else f)[:500]
                                    for r, f in failures.items()})
    except BaseException:
        result["error"] = traceback.format_exc()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    os._exit(0)
