"""Rank side of the lazy-loading property tests (imported by name in spawned gloo ranks).

A *spec* is plain data (picklable, the same on every rank and in the parent):
``[(name, dtype_name, shape, mesh_shape, placements, seed), ...]`` where
placements is None for a plain tensor, else one ``("S", dim)`` or ``("R",)`` per
mesh dimension. Every process rebuilds the same full tensors from the seeds, so
each rank can cut out its own DTensor shard and the parent can compute expectations.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.tensor import DTensor, Replicate, Shard, init_device_mesh
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from mmapckpt import MmapWriter

Spec = list[tuple[str, str, tuple[int, ...], tuple[int, ...], Any, int]]

#: the non-tensor entry every saved state dict carries
OBJECT_NAME, OBJECT_VALUE = "extra.step", [7, 0.9, 0.95]  # a list of leaves is one pickled entry


def full_tensor(dtype_name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Seeded random bytes viewed as the dtype (bool: 0/1 only)."""
    dtype = getattr(torch, dtype_name)
    n = 1
    for s in shape:
        n *= s
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw &= 1
    return raw.view(dtype).reshape(shape)


def _placements(p: Any) -> list[Any]:
    return [Shard(x[1]) if x[0] == "S" else Replicate() for x in p]


def local_state_dict(spec: Spec, meshes: dict[tuple[int, ...], Any]) -> dict[str, Any]:
    sd: dict[str, Any] = {OBJECT_NAME: OBJECT_VALUE}
    for name, dtype_name, shape, mesh_shape, placements, seed in spec:
        full = full_tensor(dtype_name, shape, seed)
        if placements is None:
            sd[name] = full
            continue
        if mesh_shape not in meshes:
            meshes[mesh_shape] = init_device_mesh("cpu", mesh_shape)
        mesh, pl = meshes[mesh_shape], _placements(placements)
        lshape, loff = compute_local_shape_and_global_offset(shape, mesh, pl)
        local = full[tuple(slice(o, o + s) for o, s in zip(loff, lshape))].contiguous()
        sd[name] = DTensor.from_local(local, mesh, pl, run_check=False, shape=full.shape, stride=full.stride())
    return sd


def save_specs(rank: int, world: int, specs: list[Spec], root: str) -> None:
    """Save every spec twice: as mmapckpt (``root/i/mm``) and stock DCP (``root/i/stock``)."""
    meshes: dict[tuple[int, ...], Any] = {}
    for i, spec in enumerate(specs):
        sd = local_state_dict(spec, meshes)
        dcp.save(sd, storage_writer=MmapWriter(os.path.join(root, str(i), "mm"), sync_files=False))
        dcp.save(sd, storage_writer=FileSystemWriter(os.path.join(root, str(i), "stock"), sync_files=False))
