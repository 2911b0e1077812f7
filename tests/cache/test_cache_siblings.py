"""A managed root at s3:// read through the cache: a step whose chunks refer to an earlier step's shard
(``../step-M/FILE``, dedup) reaches that step through ``CachedStorage.sibling`` and maps its copy."""

from __future__ import annotations

import json
import os

import torch
import torch.distributed.checkpoint as dcp
from s3_data import GetCounter, assert_same

import mmapckpt
from mmapckpt import MmapWriter
from mmapckpt.format.entries import ROOT_MARKER
from mmapckpt.storage.cache import CachedStorage
from mmapckpt.storage.location import storage_for


def _save_step(root: str, step: int, sd: dict[str, torch.Tensor], reuse: tuple[int, ...] = ()) -> None:
    w = MmapWriter(f"{root}/step-{step}", overwrite=False, reuse=[f"{root}/step-{m}" for m in reuse])
    dcp.save(sd, storage_writer=w, no_dist=True)


def test_a_step_referring_to_an_earlier_step_loads_bitwise_through_the_cache(env, bucket, cache, s3_server):
    client = s3_server.client()
    client.put_object(Bucket=bucket, Key=f"run/{ROOT_MARKER}",
                      Body=json.dumps({"format": "mmapckpt-root", "version": 1}).encode())
    root = f"s3://{bucket}/run"
    g = torch.Generator().manual_seed(3)
    s1 = {"frozen.w": torch.randn(512, 256, generator=g), "frozen.b": torch.randn(256, generator=g).bfloat16(),
          "head.w": torch.randn(64, 8, generator=g)}
    _save_step(root, 1, s1)
    s2 = dict(s1, **{"head.w": torch.randn(64, 8, generator=g)})
    _save_step(root, 2, s2, reuse=(1,))
    step2 = client.list_objects_v2(Bucket=bucket, Prefix="run/step-2/")["Contents"]
    assert sum(o["Size"] for o in step2 if o["Key"].endswith(".distcp")) < s1["frozen.w"].nbytes  # it refers

    opts = {"cache_dir": cache}
    storage = storage_for(f"{root}/step-2", options=opts)
    assert isinstance(storage.sibling("step-1"), CachedStorage)
    assert storage.sibling("step-1").location == f"{root}/step-1"
    assert_same(mmapckpt.load(f"{root}/step-2", storage_options=opts), s2, "first: ")
    copies = [n for _, _, names in os.walk(cache) for n in names if n.endswith(".distcp")]
    assert len(copies) == 2, copies  # step-2's shard and step-1's, which it refers to
    with GetCounter() as warm:
        assert_same(mmapckpt.load(f"{root}/step-2", storage_options=opts), s2, "warm load: ")
        targets = {k: torch.zeros_like(v) for k, v in s2.items()}
        dcp.load(targets, storage_reader=mmapckpt.MmapReader(f"{root}/step-2", storage_options=opts, verify=True),
                 no_dist=True)
        assert_same(targets, s2, "warm dcp.load: ")
    assert warm.bytes == 0  # both steps' shards served from their copies


def test_a_checkpoint_manager_on_a_cached_root_lists_its_steps_on_the_medium(env, bucket, cache):
    # the cache wraps the root's storage (cache_dir, or MMAPCKPT_CACHE_DIR for every URL): listing the steps, and
    # the leftovers of killed saves, must still be the medium's own
    root = f"s3://{bucket}/managed"
    opts = {"cache_dir": cache}
    m = mmapckpt.CheckpointManager(root, keep_last=2, storage_options=opts)
    sds = {s: {"w": torch.full((64, 8), float(s)), "frozen": torch.arange(4096, dtype=torch.float32)} for s in (1, 2, 3)}
    for s, sd in sds.items():
        m.save(sd, s)
    assert m.steps() == [2, 3] and m.latest() == 3
    got = {k: torch.zeros_like(v) for k, v in sds[3].items()}
    m.load(got)
    assert_same(got, sds[3], "latest through the cache: ")
    assert mmapckpt.CheckpointManager(root, storage_options=opts).steps() == [2, 3]  # a restarted job sees them
