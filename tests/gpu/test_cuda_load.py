"""mmapckpt.load(device="cuda"): through the pinned staging pool. Skipped without CUDA."""

from __future__ import annotations

import warnings

import pytest
import torch

import helpers
import lazy_dist
import mmapckpt
from mmapckpt import MmapReader, ZeroCopyLoadPlanner
from mmapckpt.io.staging import StagingPool

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
warnings.filterwarnings("ignore", message="torch.distributed is disabled")

DTYPES = ["float32", "bfloat16", "float16", "float8_e4m3fn", "int64", "bool", "complex64", "uint8"]


@pytest.fixture
def ckpt(tmp_path):
    sd = {f"t.{d}": lazy_dist.full_tensor(d, (33, 17, 5), i) for i, d in enumerate(DTYPES)}
    sd["scalar"] = torch.tensor(2.5)
    sd["empty"] = torch.empty(0, 3)
    sd["big"] = lazy_dist.full_tensor("float32", (1 << 20,), 99)  # 4 MiB: many blocks with small buffers
    path = str(tmp_path / "ck")
    helpers.dcp_save(sd, mmapckpt.MmapWriter(path, sync_files=False))
    return sd, path


@pytest.mark.parametrize("buffer_bytes, num_buffers", [(4096, 2), (1 << 20, 3), (32 << 20, 1)])
def test_cuda_load_is_bitwise_equal(ckpt, buffer_bytes, num_buffers):
    sd, path = ckpt
    out = mmapckpt.load(path, device="cuda", staging_bytes=buffer_bytes, staging_buffers=num_buffers)
    assert set(out) == set(sd)
    for k, v in sd.items():
        assert out[k].device.type == "cuda"
        helpers.assert_bitwise_equal(out[k].cpu(), v, k)


def test_cuda_load_casts_floats_only(ckpt):
    sd, path = ckpt
    # random bits: some lie past bfloat16's largest finite value, which load refuses without allow_cast
    out = mmapckpt.load(path, device="cuda", dtype=torch.bfloat16, keys=["t.float32", "t.int64"], allow_cast=True)
    assert out["t.float32"].dtype == torch.bfloat16 and out["t.int64"].dtype == torch.int64
    # The cast runs on the device (docs/lazy.md), so it is the device's conversion, bit for bit. It agrees
    # with the CPU's except in how a NaN is spelled: CUDA writes 0x7FFF, the CPU 0x7FC0.
    helpers.assert_bitwise_equal(out["t.float32"].cpu(), sd["t.float32"].cuda().to(torch.bfloat16).cpu())
    on_cpu, nan = sd["t.float32"].to(torch.bfloat16), sd["t.float32"].isnan()
    helpers.assert_bitwise_equal(out["t.float32"].cpu()[~nan], on_cpu[~nan])
    assert out["t.float32"].cpu()[nan].isnan().all()


def test_pool_is_pinned_and_bounded():
    with StagingPool("cuda", staging_bytes=1 << 20, staging_buffers=3) as pool:
        assert all(b.is_pinned() for b in pool.buffers)
        assert sum(b.numel() for b in pool.buffers) == 3 << 20
        src = torch.arange(3 << 20, dtype=torch.uint8)
        dst = torch.empty_like(src, device="cuda")
        pool.copy(src, dst)
    assert torch.equal(dst.cpu(), src)
    assert sum(pool.blocks_per_buffer) == 3


def test_current_stream_work_is_ordered_before_the_copies():
    # The destination is written by the current stream just before the load; the side
    # stream must not overtake it (the pool waits for the current stream on entry).
    dst = torch.empty(1 << 22, device="cuda")
    dst.fill_(1.0)
    src = torch.full((1 << 22,), 2.0)
    with StagingPool("cuda", staging_bytes=1 << 20, staging_buffers=2) as pool:
        pool.copy(src, dst)
    assert bool((dst == 2.0).all())


def test_meta_model_from_cuda_load(tmp_path):
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64, batch_first=True)
    model = torch.nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False).eval()
    path = str(tmp_path / "m")
    helpers.dcp_save(model.state_dict(), mmapckpt.MmapWriter(path, sync_files=False))
    with torch.device("meta"):
        layer2 = torch.nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64, batch_first=True)
        fresh = torch.nn.TransformerEncoder(layer2, num_layers=2, enable_nested_tensor=False).eval()
    fresh.load_state_dict(mmapckpt.load(path, device="cuda"), assign=True)
    model = model.cuda()
    x = torch.randn(3, 7, 32, device="cuda")
    with torch.no_grad():
        helpers.assert_bitwise_equal(fresh(x), model(x))


def test_zero_copy_planner_copies_into_cuda_targets(ckpt):
    sd, path = ckpt
    targets = {"t.float32": torch.zeros(33, 17, 5, device="cuda")}
    before = targets["t.float32"]
    import torch.distributed.checkpoint as dcp

    dcp.load(targets, storage_reader=MmapReader(path), planner=ZeroCopyLoadPlanner(allow_partial_load=True),
             no_dist=True)
    assert targets["t.float32"] is before
    helpers.assert_bitwise_equal(before.cpu(), sd["t.float32"])
