"""The rank function of the multi-rank managed save (run by tests/helpers.py ``run_distributed``)."""

from __future__ import annotations

import torch
from manage_data import state
from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

import mmapckpt


def sharded(step: int, mesh) -> dict:
    full = state(step)
    return {"model.w": distribute_tensor(full["model.w"], mesh, [Shard(0)]),
            "model.emb": distribute_tensor(full["model.emb"], mesh, [Shard(1)]), "step": step}


def save_steps(rank: int, world: int, root: str) -> None:
    """Every rank saves steps 1 to 3 with keep_last=1, then loads the latest into fresh DTensors of the same mesh."""
    mesh = init_device_mesh("cpu", (world,))
    m = mmapckpt.CheckpointManager(root, keep_last=1)
    for step in (1, 2, 3):
        m.save(sharded(step, mesh), step)
    targets = sharded(0, mesh)
    assert m.load(targets) == 3  # the coordinator chose it after its retention of step 3: every rank sees it
    assert m.steps() == [3], m.steps()  # retention ran on the coordinator
    want = sharded(3, mesh)
    for k in ("model.w", "model.emb"):
        assert torch.equal(targets[k].to_local().view(torch.uint8), want[k].to_local().view(torch.uint8)), k
    assert targets["step"] == 3
