"""Two gloo ranks loading one URL through one cache, with ``read_once=True`` and without: bitwise, and the store
asked for each byte once in all (counted at each rank's client)."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import helpers
from s3_data import GetCounter, assert_same, complement, state_dict

import mmapckpt
from mmapckpt import MmapReader

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]
warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def _ranks(rank: int, world: int, url: str, cache: str, out: str) -> None:
    want = state_dict(salt=4)
    ranges = []
    for read_once in (True, False):
        targets = {n: complement(t) for n, t in want.items()}
        dist.barrier()
        with GetCounter() as gets:
            dcp.load(targets, storage_reader=MmapReader(url, read_once=read_once, storage_options={"cache_dir": cache}))
        assert_same(targets, want, f"rank {rank} read_once={read_once}: ")
        ranges += gets.ranges
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(ranges, f)


def test_two_ranks_through_one_cache(env, bucket, cache, s3_server, tmp_path):
    from test_cache_loads import each_byte_once
    url = f"s3://{bucket}/ck"
    mmapckpt.save(state_dict(salt=4), url)
    helpers.run_distributed(_ranks, 2, url, cache, str(tmp_path))
    together = GetCounter()
    together.ranges = [tuple(r) for k in range(2) for r in json.loads((tmp_path / f"rank{k}.json").read_text())]
    assert each_byte_once(together, s3_server.client(), bucket) > 12 << 20
