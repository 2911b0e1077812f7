"""Two gloo ranks on ``az://`` (Azurite): DTensor saves loaded resharded, and read-once loads fetching each byte once.

As tests/s3/test_s3_distributed.py on S3: the multi-rank tests' state dict (tests/distributed/
dist_ranks.py: DTensor shards, replicated DTensors, plain tensors; bf16, fp8, NaN payloads, -0.0)
is saved with MmapWriter and loaded resharded (Shard(0) <-> Shard(1), Replicate <-> Shard) through
MmapReader, bit for bit; a replicated state dict is loaded with and without ``read_once=True``,
counting the bytes each rank's storage received from the service.
"""

from __future__ import annotations

import json
import os
import sys
import warnings

import pytest
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import init_device_mesh

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "distributed"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "s3"))
import dist_ranks as dr  # noqa: E402
import helpers  # noqa: E402
from s3_data import assert_same, complement, state_dict  # noqa: E402

import mmapckpt  # noqa: E402
from mmapckpt import MmapReader, MmapWriter  # noqa: E402

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]
warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def _ranks(rank: int, world: int, root: str, out: str) -> None:
    mesh = init_device_mesh("cpu", (world,))
    mine = f"{root}/dtensors"
    dcp.save(dr.build_state_dict(mesh, dr.SAVE, sentinel=False), storage_writer=MmapWriter(mine))
    sd = dr.build_state_dict(mesh, dr.ALT, sentinel=True)
    dcp.load(sd, storage_reader=MmapReader(mine))
    dr.check_state_dict(sd, mesh, dr.ALT)

    replicated = f"{root}/replicated"
    want = state_dict(salt=9)
    dcp.save(want, storage_writer=MmapWriter(replicated, storage_options={"upload_part_size": 2 << 20}))
    counts = {}
    for read_once in (False, True):
        targets = {n: complement(t) for n, t in want.items()}
        dist.barrier()
        reader = MmapReader(replicated, read_once=read_once, storage_options={"part_size": 1 << 20})
        dcp.load(targets, storage_reader=reader)
        assert_same(targets, want, f"rank {rank} read_once={read_once}: ")
        counts[str(read_once)] = {"received": reader.storage.stats.bytes, "bytes_read": reader.bytes_read}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(counts, f)


def test_two_ranks_on_azure(az_env, az_container, tmp_path):
    root = f"az://{az_container}/dist"
    helpers.run_distributed(_ranks, 2, root, str(tmp_path))
    counts = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    data = sum(t.nbytes for t in state_dict(salt=9).values())
    alone = [c["False"]["received"] for c in counts]
    once = sum(c["True"]["received"] for c in counts)
    assert all(data <= b <= 1.1 * data for b in alone), (alone, data)  # each rank fetched everything itself
    assert data <= once <= 1.1 * data, (once, data)  # read once: each stored byte fetched about once in all
    assert sum(c["True"]["bytes_read"] for c in counts) == data
    plain = dr.build_state_dict(None, dr.PLAIN, sentinel=True)  # the 2-rank checkpoint in one process (2 -> 1)
    dcp.load(plain, storage_reader=MmapReader(f"{root}/dtensors"), no_dist=True)
    dr.check_state_dict(plain, None, dr.PLAIN)
    loaded = mmapckpt.load(f"{root}/dtensors")
    for fqn in dr.TENSORS:
        helpers.assert_bitwise_equal(loaded[fqn], dr.full_tensor(fqn), fqn)
