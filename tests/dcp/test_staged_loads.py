"""The accelerator staging pipeline through dcp.load, load_into and load, run on the CPU.

Targets on accelerators go through the pinned ring (io/staging.py). Here the same code
runs with CPU targets routed through it (ordinary buffers, tiny ones to force packing,
pieces and reuse): every load is compared bitwise with the source and with the stock
reader, and commit_tensor must never see an incomplete target. tests/gpu repeats the
properties on CUDA; tests/distributed loads resharded checkpoints the same way.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

import helpers
import mmapckpt
import strategies
from mmapckpt.io import staging


def _staged_reader(path, **kw) -> mmapckpt.MmapReader:
    r = mmapckpt.MmapReader(path, **kw)
    r._stage_cpu_targets = True
    return r


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(sd=strategies.tensor_state_dicts(), cap=st.sampled_from([64, 256, 4096]), buffers=st.integers(1, 3))
def test_dcp_load_through_the_pipeline_is_bitwise_and_commits_complete_targets(tmp_path_factory, sd, cap, buffers):
    path = str(tmp_path_factory.mktemp("c"))
    helpers.dcp_save(sd, mmapckpt.MmapWriter(path, sync_files=False))
    reader = _staged_reader(path, staging_bytes=cap, staging_buffers=buffers)
    planner = helpers.checksum_at_commit_planner()

    got = strategies.fresh_like(sd, 0xA5)
    dcp.load(got, storage_reader=reader, planner=planner, no_dist=True)
    helpers.assert_tree_equal(got, sd)
    stock_path = str(tmp_path_factory.mktemp("s"))  # the stock writer and reader on the same input
    helpers.dcp_save(sd, FileSystemWriter(stock_path))
    helpers.assert_tree_equal(got, helpers.dcp_load(strategies.fresh_like(sd, 0x5A), FileSystemReader(stock_path)))
    flat = strategies.flatten(got)
    assert planner.seen == {k: helpers.tensor_bytes(v) for k, v in flat.items() if k in planner.seen}
    assert all(pool.max_in_use <= buffers for pool in reader._pools.values())


def test_the_ring_is_allocated_once_per_reader_and_freed_on_close(tmp_path):
    sd = {"a": torch.randn(300), "b": torch.arange(7, dtype=torch.int64)}
    helpers.dcp_save(sd, mmapckpt.MmapWriter(tmp_path, sync_files=False))
    reader = _staged_reader(tmp_path, staging_bytes=512, staging_buffers=2)
    for _ in range(3):
        helpers.assert_tree_equal(helpers.dcp_load(strategies.fresh_like(sd, 1), reader), sd)
    (pool,) = reader._pools.values()
    assert sum(pool.blocks_per_buffer) >= 3 * 4  # the same buffers served all three loads
    slots = pool._ring.slots
    reader.close()
    assert reader._pools == {} and pool._ring.slots == [] and len(slots) == 2
    helpers.assert_tree_equal(helpers.dcp_load(strategies.fresh_like(sd, 1), reader), sd)  # allocated again


def test_a_cast_target_gets_copy_semantics(tmp_path):
    src = torch.randn(100).to(torch.bfloat16)
    helpers.dcp_save({"w": src}, mmapckpt.MmapWriter(tmp_path, sync_files=False))
    reader = _staged_reader(tmp_path, staging_bytes=64)
    out = {"w": torch.zeros(100, dtype=torch.bfloat16)}
    helpers.dcp_load(out, reader)
    helpers.assert_bitwise_equal(out["w"], src)


@pytest.fixture
def staged_cpu(monkeypatch):
    monkeypatch.setattr(staging, "STAGE_CPU_TARGETS", True)


def test_load_into_through_the_pipeline(tmp_path, staged_cpu):
    g = torch.Generator().manual_seed(3)
    sd = {"big": torch.randn(3000, generator=g), "tiny": torch.tensor(-0.0),
          "bf": torch.randn(5, 7, generator=g).to(torch.bfloat16), "empty": torch.empty(0, 4),
          "f8": torch.randn(33, generator=g).to(torch.float8_e4m3fn)}
    mmapckpt.save(sd, tmp_path / "c")
    targets = {k: torch.full_like(v, 1) if v.numel() else torch.empty_like(v) for k, v in sd.items()}
    targets["cast"] = torch.zeros(3000, dtype=torch.float64)  # copy_ casts, as without the pipeline
    mmapckpt.save({**sd, "cast": sd["big"]}, tmp_path / "d")
    mmapckpt.load_into(targets, tmp_path / "d", staging_bytes=1024, staging_buffers=2)
    for k, v in sd.items():
        helpers.assert_bitwise_equal(targets[k], v, k)
    helpers.assert_bitwise_equal(targets["cast"], sd["big"].to(torch.float64))


def test_stock_checkpoints_go_through_the_pipeline_too(tmp_path):
    sd = {"w": torch.randn(40, 3), "i": torch.arange(5)}
    helpers.dcp_save(sd, FileSystemWriter(tmp_path))
    reader = _staged_reader(tmp_path, staging_bytes=128, staging_buffers=2)
    helpers.assert_tree_equal(helpers.dcp_load(strategies.fresh_like(sd, 7), reader), sd)
    assert sum(next(iter(reader._pools.values())).blocks_per_buffer) >= 4
