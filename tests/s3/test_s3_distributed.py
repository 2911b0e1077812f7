"""Multi-rank saves and loads on an object store: real gloo ranks (2), real DTensors, the real radosgw.

One spawn of 2 ranks:
- saves the multi-rank tests' state dict (tests/distributed/dist_ranks.py: DTensor shards,
  replicated DTensors, plain tensors, non-tensor values; bf16, fp8, NaN payloads, -0.0) to
  ``s3://`` with MmapWriter and with DCP's own FsspecWriter, and loads both resharded
  (Shard(0) <-> Shard(1), Replicate <-> Shard) through MmapReader, bit for bit;
- loads a replicated state dict (every rank wants all of it) with and without
  ``read_once=True``, counting at each rank's client the GET requests and bytes it asked
  of the store: read once, the two ranks together fetch each stored byte about once, and
  make about half the data requests, where each rank alone fetches all of it otherwise
  (each rank still reads ``.metadata`` and the shard header itself: a few requests).
The parent then loads the 2-rank checkpoint in one process (resharded 2 -> 1).
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
import dist_ranks as dr  # noqa: E402
import helpers  # noqa: E402
from s3_data import SMALL_PARTS, GetCounter, assert_same, complement, state_dict  # noqa: E402

import mmapckpt  # noqa: E402
from mmapckpt import MmapReader, MmapWriter  # noqa: E402

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]
warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def _ranks(rank: int, world: int, root: str, out: str) -> None:
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
    mesh = init_device_mesh("cpu", (world,))
    mine, stock = f"{root}/dtensors", f"{root}/dtensors-stock"
    dcp.save(dr.build_state_dict(mesh, dr.SAVE, sentinel=False), storage_writer=MmapWriter(mine))
    dcp.save(dr.build_state_dict(mesh, dr.SAVE, sentinel=False), storage_writer=FsspecWriter(stock))
    for url in (mine, stock):
        sd = dr.build_state_dict(mesh, dr.ALT, sentinel=True)
        dcp.load(sd, storage_reader=MmapReader(url))
        dr.check_state_dict(sd, mesh, dr.ALT)
    theirs = dr.build_state_dict(mesh, dr.ALT, sentinel=True)
    dcp.load(theirs, storage_reader=FsspecReader(stock))
    dr.check_state_dict(theirs, mesh, dr.ALT)

    replicated = f"{root}/replicated"
    want = state_dict(salt=9)
    dcp.save(want, storage_writer=MmapWriter(replicated, storage_options=SMALL_PARTS))
    counts = {}
    for read_once in (False, True):
        targets = {n: complement(t) for n, t in want.items()}
        dist.barrier()
        options = {"part_size": 1 << 20}  # 1 MiB GETs: about 13 for the state dict's 12.6 MB
        reader = MmapReader(replicated, read_once=read_once, storage_options=options)
        with GetCounter(options) as gets:
            dcp.load(targets, storage_reader=reader)
        assert_same(targets, want, f"rank {rank} read_once={read_once}: ")
        data = [r for r in gets.ranges if r[0].endswith(".distcp") and r[1] > 0]  # not .metadata or a shard header
        counts[str(read_once)] = {"bytes": gets.bytes, "requests": gets.requests, "data_requests": len(data),
                                  "bytes_read": reader.bytes_read}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(counts, f)


def test_two_ranks_on_s3(s3_env, s3_bucket, tmp_path):
    root = f"s3://{s3_bucket}/dist"
    helpers.run_distributed(_ranks, 2, root, str(tmp_path))
    counts = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    data = sum(t.nbytes for t in state_dict(salt=9).values())
    alone = [c["False"]["bytes"] for c in counts]
    once = sum(c["True"]["bytes"] for c in counts)
    assert all(data <= b <= 1.1 * data for b in alone), (alone, data)  # each rank fetched everything itself
    assert data <= once <= 1.1 * data, (once, data)  # read once: each stored byte fetched about once in all
    # what the readers say they read: every stored byte by each rank alone, by one rank in all read once
    assert [c["False"]["bytes_read"] for c in counts] == [data, data]
    assert sum(c["True"]["bytes_read"] for c in counts) == data
    # the requests for data halve; each rank still reads .metadata and the shard header itself
    req_alone = sum(c["False"]["data_requests"] for c in counts)
    req_once = sum(c["True"]["data_requests"] for c in counts)
    assert req_once <= 0.6 * req_alone, (req_once, req_alone)
    # the rest: .metadata, and a shard's first 64 KiB (its header) where a rank opens it (each pass opens it)
    assert all(c[k]["requests"] - c[k]["data_requests"] <= 3 for c in counts for k in c), counts
    # the 2-rank DTensor checkpoint in one process, as plain tensors (2 -> 1)
    plain = dr.build_state_dict(None, dr.PLAIN, sentinel=True)
    dcp.load(plain, storage_reader=MmapReader(f"{root}/dtensors"), no_dist=True)
    dr.check_state_dict(plain, None, dr.PLAIN)
    loaded = mmapckpt.load(f"{root}/dtensors")
    for fqn in dr.TENSORS:
        helpers.assert_bitwise_equal(loaded[fqn], dr.full_tensor(fqn), fqn)
