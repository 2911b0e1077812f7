"""MmapWriter with tensors on a CUDA device: staged through pinned memory, bitwise equal."""

import pytest
import torch
import torch.distributed.checkpoint as dcp

from helpers import assert_bitwise_equal
from mmapckpt import MmapReader, MmapWriter
from mmapckpt.io.d2h import stage_to_host

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_save_cuda_tensors_roundtrip(tmp_path):
    g = torch.Generator(device="cuda").manual_seed(0)
    base = torch.randn(256, 512, device="cuda", generator=g)
    sd = {
        "w": base.to(torch.bfloat16),
        "t": base.t(),  # non-contiguous
        "s": base[3:9, ::4],  # strided view into a larger storage
        "big": torch.randn(8 << 20, device="cuda", generator=g),  # larger than the pinned budget
    }
    dcp.save(sd, storage_writer=MmapWriter(tmp_path), no_dist=True)
    out = {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in sd.items()}
    dcp.load(out, storage_reader=MmapReader(tmp_path), no_dist=True)
    for k in sd:
        assert_bitwise_equal(out[k], sd[k].cpu(), k)


def test_stage_to_host_keeps_order_and_bounds(tmp_path):
    ts = [torch.full((1 << 20,), float(i), device="cuda") for i in range(10)]
    seen = []
    for i, host in stage_to_host(range(10), lambda i: ts[i], budget=3 << 20):
        assert host.device.type == "cpu" and host.is_pinned()
        seen.append(i)
        assert host[0].item() == float(i)
    assert seen == list(range(10))
