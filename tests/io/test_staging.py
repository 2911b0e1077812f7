"""The staging pool's logic on the CPU: block planning and buffer rotation.

The CUDA specifics (pinned buffers, side stream, events) run only in
tests/gpu/test_cuda_load.py; here the same copy loop runs synchronously into
CPU destinations, with buffers small enough to force many blocks and reuse.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import helpers
import lazy_dist
from mmapckpt.io.staging import StagingPool, plan_blocks

shapes = st.lists(st.integers(0, 6), min_size=0, max_size=4).map(tuple)


@settings(max_examples=200, deadline=None)
@given(shape=shapes, itemsize=st.sampled_from([1, 2, 4, 8, 16]), cap_items=st.integers(1, 40))
def test_blocks_tile_the_tensor_in_byte_order(shape, itemsize, cap_items):
    cap = cap_items * itemsize + (cap_items % 3)  # caps that are not a multiple of the item size too
    numel = math.prod(shape)
    ref = torch.arange(numel).reshape(shape)
    pos = 0
    for b in plan_blocks(shape, itemsize, cap):
        assert b.start == pos and 0 < b.nbytes <= cap and b.nbytes % itemsize == 0
        elems = ref[b.index].reshape(-1)
        assert torch.equal(elems, torch.arange(b.start // itemsize, (b.start + b.nbytes) // itemsize))
        pos += b.nbytes
    assert pos == numel * itemsize


def test_blocks_are_big_when_rows_fit():
    blocks = list(plan_blocks((100, 10), 4, 1000))  # 40-byte rows, 25 rows a block
    assert [b.nbytes for b in blocks] == [1000] * 4
    with pytest.raises(ValueError):
        list(plan_blocks((3,), 8, 7))


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16", "float8_e4m3fn", "bool", "complex128", "int64"])
@pytest.mark.parametrize("buffer_bytes, num_buffers", [(16, 1), (24, 2), (40, 3), (1 << 20, 2)])
def test_pool_copies_into_strided_regions(dtype_name, buffer_bytes, num_buffers):
    src = lazy_dist.full_tensor(dtype_name, (7, 3, 5), 11)
    big = torch.zeros((9, 4, 11), dtype=src.dtype)
    region = big[1:8, 1:4, ::2][:, :, :5]  # a non-contiguous destination, like a chunk's place in a tensor
    assert not region.is_contiguous()
    with StagingPool("cpu", buffer_bytes=buffer_bytes, num_buffers=num_buffers) as pool:
        pool.copy(src, region)
    helpers.assert_bitwise_equal(region, src)
    untouched = big.clone()
    untouched[1:8, 1:4, ::2][:, :, :5] = 0
    assert not untouched.view(torch.uint8).any()  # nothing outside the region was written
    n = len(list(plan_blocks(tuple(src.shape), src.element_size(), buffer_bytes)))
    assert sum(pool.blocks_per_buffer) == n
    assert max(pool.blocks_per_buffer) - min(pool.blocks_per_buffer) <= 1  # round robin


def test_pool_handles_scalars_empty_and_odd_strides():
    with StagingPool("cpu", buffer_bytes=8, num_buffers=2) as pool:
        scalar, out = torch.tensor(3.5, dtype=torch.float64), torch.zeros((), dtype=torch.float64)
        pool.copy(scalar, out)
        empty = torch.empty(0, 4)
        pool.copy(empty, torch.empty(0, 4))
        odd = torch.arange(10, dtype=torch.bfloat16)[4:5:4]  # contiguous, yet stride 4 on its size-1 dim
        dst = torch.zeros(1, dtype=torch.bfloat16)
        pool.copy(odd, dst)
    assert out.item() == 3.5 and dst.item() == 4.0
    with pytest.raises(ValueError):
        StagingPool("cpu").copy(torch.zeros(3), torch.zeros(4))
    with pytest.raises(ValueError):
        StagingPool("cpu", num_buffers=0)
