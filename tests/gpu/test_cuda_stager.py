"""PinnedStager with CUDA tensors: page-locked reused buffers, the copy complete when stage() returns, bitwise."""

import gc

import pytest
import torch
import torch.distributed.checkpoint as dcp

from helpers import assert_bitwise_equal, seeded_tensor
from mmapckpt import MmapReader, MmapWriter, PinnedStager

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]


def _state_dict() -> dict:
    base = torch.randn(1024, 1024, device="cuda")
    return {
        "w": seeded_tensor("w", (512, 257), torch.bfloat16).cuda(),
        "fp8": seeded_tensor("f", (3, 1000), torch.float8_e4m3fn).cuda(),
        "big": torch.randn(16 << 20, device="cuda"),  # 64 MB: a copy that takes a while
        "t": base.t(),  # non-contiguous
        "cpu": seeded_tensor("c", (77,), torch.float32),  # a CPU tensor in a CUDA state dict
        "opt": {"step": 10, "m": [torch.ones(3, device="cuda"), None]},
    }


def test_stage_copies_into_reused_pinned_buffers_and_is_complete_on_return() -> None:
    sd = _state_dict()
    st = PinnedStager()
    last: list[int] = []
    for i in range(3):
        want = {k: sd[k].to("cpu", copy=True) for k in ("w", "fp8", "big", "t", "cpu")}
        # queue work on the current stream that the copy must wait for: the staged bytes are these
        sd["big"].mul_(2.0)
        want["big"] = want["big"] * 2.0
        staged = st.stage(sd)
        # mutate on the current stream right away: a copy still in flight would see it
        for k in ("w", "fp8", "big", "t"):
            sd[k].view(torch.uint8).bitwise_not_() if sd[k].is_contiguous() else sd[k].add_(1)
        sd["cpu"].add_(1)
        for k in want:
            assert staged[k].device.type == "cpu"
            assert_bitwise_equal(staged[k], want[k], f"save {i} {k}")
        for k in ("w", "fp8", "big", "t"):
            assert staged[k].is_pinned(), k
        assert not staged["cpu"].is_pinned()  # CPU tensors are staged into plain memory
        ptrs = [staged[k].data_ptr() for k in want]
        if last:
            assert ptrs == last, "the buffers were not reused"
        last = ptrs
        del staged
        gc.collect()
    assert st.allocations == 6 and st.fresh_copies == 0
    st.close()


def test_async_save_from_cuda_is_bitwise_the_state_at_the_call(tmp_path) -> None:
    sd = _state_dict()
    flat = {k: v for k, v in sd.items() if isinstance(v, torch.Tensor)}
    want = {k: v.to("cpu", copy=True) for k, v in flat.items()}
    st = PinnedStager()
    fut = dcp.async_save(flat, storage_writer=MmapWriter(str(tmp_path)), async_stager=st, no_dist=True)
    for v in flat.values():
        v.zero_()
    fut.result()
    got = {k: torch.empty(v.shape, dtype=v.dtype) for k, v in want.items()}
    dcp.load(got, storage_reader=MmapReader(str(tmp_path)), no_dist=True)
    for k in want:
        assert_bitwise_equal(got[k], want[k], k)
    st.close()


def test_registered_pages_are_released_after_close() -> None:
    st = PinnedStager()
    staged = st.stage({"x": torch.ones(1 << 20, device="cuda")})
    ptr = staged["x"].data_ptr()
    assert ptr % 4096 == 0 and staged["x"].is_pinned()
    st.close()
    assert staged["x"].is_pinned()  # a save still holding it keeps its memory
    del staged
    gc.collect()
    # freed and unregistered: registering the same pages again must not fail as "already registered"
    st2 = PinnedStager()
    again = st2.stage({"x": torch.ones(1 << 20, device="cuda")})
    assert again["x"].is_pinned()
    st2.close()
