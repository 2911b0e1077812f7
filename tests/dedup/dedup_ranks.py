"""The rank function of the 2-rank dedup test (imported by name in spawned gloo ranks)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor, Replicate, Shard, init_device_mesh

from helpers import seeded_tensor
from mmapckpt import MmapWriter


def full(name: str, step: int) -> torch.Tensor:
    """The whole tensor ``name`` at ``step`` (the same on every rank): ``trained`` changes, the rest do not."""
    shapes = {"frozen": ((37, 12), torch.float8_e5m2), "trained": ((9, 5), torch.float32),
              "rep": ((6, 4), torch.float16)}
    shape, dtype = shapes[name]
    return seeded_tensor(name + (f"@{step}" if name == "trained" else ""), shape, dtype)


def _dtensor(t: torch.Tensor, mesh: Any, shard: bool) -> DTensor:
    """``t`` as a DTensor, each rank's part cut locally (gloo scatters no float8)."""
    if not shard:
        return DTensor.from_local(t, mesh, [Replicate()], run_check=False)
    local = torch.chunk(t, mesh.size(), dim=0)[mesh.get_local_rank()].clone()
    return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=t.shape, stride=t.stride())


def state(mesh: Any, step: int) -> dict[str, object]:
    return {"frozen": _dtensor(full("frozen", step), mesh, True), "trained": _dtensor(full("trained", step), mesh, True),
            "rep": _dtensor(full("rep", step), mesh, False), "step": step}


def save_two_steps(rank: int, world: int, root: str) -> None:
    mesh = init_device_mesh("cpu", (world,))
    dcp.save(state(mesh, 1), storage_writer=MmapWriter(f"{root}/step-1", overwrite=False))
    dcp.save(state(mesh, 2), storage_writer=MmapWriter(f"{root}/step-2", overwrite=False, reuse=[f"{root}/step-1"]))
