"""Read-once loads into CUDA targets: over NCCL (2 GPUs, pieces travel device to device and are
received straight into whole-chunk targets) and over gloo with CUDA targets (1 GPU is enough).

Skipped without the GPUs they need. Each rank loads a checkpoint saved in this process as
full (replicated) tensors and as DTensor shards of another split, checks them bit for bit,
and the bytes read over all ranks must be the checkpoint's stored bytes.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

import helpers
import lazy_dist
import mmapckpt
from mmapckpt import MmapReader

pytestmark = [pytest.mark.gpu, pytest.mark.distributed, pytest.mark.timeout(300),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

DTYPES = ["float32", "bfloat16", "float8_e4m3fn", "int64", "bool", "complex64"]


def _full() -> dict[str, torch.Tensor]:
    sd = {f"t.{d}": lazy_dist.full_tensor(d, (37, 21), i) for i, d in enumerate(DTYPES)}
    sd["big"] = lazy_dist.full_tensor("float32", (1 << 18, 4), 99)  # 4 MiB: many pieces of 256 KiB
    return sd


def _ranks(rank: int, world: int, path: str, out: str) -> None:
    full, got = _full(), {}
    targets = {k: torch.empty_like(v, device="cuda") for k, v in full.items()}
    reader = MmapReader(path, read_once=True, read_once_piece_bytes=256 << 10)
    dcp.load(targets, storage_reader=reader)
    for k, v in full.items():
        helpers.assert_bitwise_equal(targets[k].cpu(), v, k)
    got["replicated"] = reader.bytes_read
    mesh = init_device_mesh("cuda", (world,))
    sharded = {k: distribute_tensor(torch.empty_like(v), mesh, [Shard(v.dim() - 1)], src_data_rank=None)
               for k, v in full.items()}
    reader = MmapReader(path, read_once=True, read_once_min_share=0.0, read_once_piece_bytes=1000)
    dcp.load(sharded, storage_reader=reader)
    for k, v in full.items():
        want = distribute_tensor(v.cuda(), mesh, [Shard(v.dim() - 1)], src_data_rank=None).to_local()
        helpers.assert_bitwise_equal(sharded[k].to_local().cpu(), want.cpu(), k)
    got["sharded"] = reader.bytes_read
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(got, f)


def _run(backend: str, tmp_path: Any) -> list[dict[str, int]]:
    path, out = str(tmp_path / "ck"), str(tmp_path / "out")
    os.makedirs(out)
    helpers.dcp_save(_full(), mmapckpt.MmapWriter(path))
    helpers.run_distributed(_ranks, 2, path, out, backend=backend)  # nccl: rank r on device r; gloo: both on device 0
    stored = sum(i.length for i in MmapReader(path).read_metadata().storage_data.values())
    res = []
    for r in range(2):
        with open(os.path.join(out, f"rank{r}.json")) as f:
            res.append(json.load(f))
    assert sum(r["replicated"] for r in res) == stored
    return res


@pytest.mark.skipif(torch.cuda.device_count() < 2 or not dist.is_nccl_available(), reason="needs 2 GPUs and NCCL")
def test_read_once_over_nccl_into_device_targets(tmp_path: Any) -> None:
    _run("nccl", tmp_path)


def test_read_once_over_gloo_into_device_targets(tmp_path: Any) -> None:
    _run("gloo", tmp_path)
