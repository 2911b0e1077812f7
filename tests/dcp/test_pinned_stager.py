"""PinnedStager with the real ``dcp.async_save``: what is saved is the state dict as it was at the call,
host buffers are reused (and reallocated when a tensor changes), never overwritten while a previous
staged dict is alive, and freed by close(). CUDA behaviour (pinned buffers, streams) is in tests/gpu."""

from __future__ import annotations

import collections
import gc
import io
import os
import weakref
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import AsyncStager

import helpers
import mmapckpt
from mmapckpt import MmapReader, MmapWriter, PinnedStager
from mmapckpt.io.d2h import pin_pages

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _state_dict() -> dict[str, Any]:
    """Model tensors of several dtypes (NaN payloads, -0.0 from seeded_tensor) and optimizer-like state."""
    t = helpers.seeded_tensor
    return {
        "model": {
            "emb.weight": t("emb", (33, 8), torch.bfloat16),
            "proj.weight": t("proj", (8, 21), torch.float32),
            "scale": t("scale", (5, 7), torch.float8_e4m3fn),
            "ids": t("ids", (9,), torch.int64),
            "mask": t("mask", (3, 5), torch.bool),
            "zero_dim": t("zd", (), torch.float64),
        },
        "optim": {
            "state": {0: {"step": t("st", (), torch.float32), "exp_avg": t("m", (13, 6), torch.float8_e5m2),
                          "exp_avg_sq": t("v", (6, 10), torch.float16)}},
            "param_groups": [{"lr": 3e-4, "betas": (0.9, 0.95), "params": [0, 1], "foreach": None,
                              "name": "all"}],
        },
        "step": 1234,
    }


def _clone(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.clone()
    if isinstance(x, dict):
        return {k: _clone(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_clone(v) for v in x)
    return x


def _tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, dict):
        return [t for v in x.values() for t in _tensors(v)]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _tensors(v)]
    return []


def _scramble(sd: dict[str, Any]) -> None:
    """What training does right after async_save returns: every tensor's bytes and the plain values change."""
    for t in _tensors(sd):
        t.view(-1).view(torch.uint8).bitwise_not_() if t.numel() else None
    sd["step"] = -1
    sd["optim"]["param_groups"][0]["lr"] = 1.0
    sd["optim"]["param_groups"][0]["params"].append(2)


def _load(path: str) -> dict[str, Any]:
    targets = _state_dict()
    for t in _tensors(targets):
        t.view(-1).view(torch.uint8).fill_(0x5A) if t.numel() else None  # every byte not loaded shows
    targets["step"] = 0
    targets["optim"]["param_groups"] = [{"lr": 0.0, "betas": (0.0, 0.0), "params": [], "foreach": 1, "name": ""}]
    dcp.load(targets, storage_reader=MmapReader(path), no_dist=True)
    return targets


def _ptrs(staged: Any) -> list[int]:
    return [t.data_ptr() for t in _tensors(staged)]


def test_is_an_async_stager_that_async_save_does_not_wait_on() -> None:
    st = PinnedStager()
    assert isinstance(st, AsyncStager) and not st.should_synchronize_after_execute
    assert mmapckpt.PinnedStager is PinnedStager


def test_async_save_writes_the_state_dict_as_it_was_at_the_call(tmp_path) -> None:
    sd = _state_dict()
    want = _clone(sd)
    st = PinnedStager()
    fut = dcp.async_save(sd, storage_writer=MmapWriter(str(tmp_path / "c")), async_stager=st, no_dist=True)
    _scramble(sd)  # the training loop goes on at once; the background write must not see this
    fut.result()
    helpers.assert_tree_equal(want, _load(str(tmp_path / "c")))
    st.close()


def test_staged_copy_has_the_structure_and_values_of_dcps_own_stager() -> None:
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    sd = _state_dict()
    sd["extra"] = collections.OrderedDict(a=torch.ones(2), blob=io.BytesIO(b"xyz"), nt=(torch.zeros(1), "s"))
    sd["model"]["alias"] = sd["model"]["ids"]  # one tensor under two names
    mine = PinnedStager().stage(sd)
    stock = DefaultStager(StagingOptions(False, False, False, False)).stage(sd)
    assert type(mine["extra"]) is collections.OrderedDict and mine["extra"]["blob"].getvalue() == b"xyz"
    assert mine["extra"]["blob"] is not sd["extra"]["blob"]  # deep-copied, as DCP does
    mine["extra"]["blob"] = stock["extra"]["blob"] = None
    helpers.assert_tree_equal(stock, mine)
    assert mine["model"]["alias"] is mine["model"]["ids"]
    for src, got in zip(_tensors(sd), _tensors(mine)):
        assert got.device.type == "cpu" and got.data_ptr() != src.data_ptr() and not got.requires_grad


def test_buffers_are_reused_across_three_async_saves(tmp_path) -> None:
    sd = _state_dict()
    st = PinnedStager(grace_s=30.0)  # waits only until the finished save's thread lets its staged dict go
    n = len(_tensors(sd))
    for i in range(3):
        want = _clone(sd)
        dcp.async_save(sd, storage_writer=MmapWriter(str(tmp_path / str(i))), async_stager=st,
                       no_dist=True).result()
        _scramble(sd)
        helpers.assert_tree_equal(want, _load(str(tmp_path / str(i))))
        assert st.allocations == n and st.fresh_copies == 0, (i, st.allocations, st.fresh_copies)


def test_stage_reuses_the_same_memory_and_reallocates_what_changed() -> None:
    sd = _state_dict()
    st = PinnedStager()
    first = _ptrs(st.stage(sd))  # dropped at once: the buffers are free again
    _scramble(sd)
    again = st.stage(sd)
    assert _ptrs(again) == first and st.allocations == len(first)
    helpers.assert_tree_equal(_clone(sd), again)  # the new values, in the old memory
    del again
    sd["model"]["proj.weight"] = torch.ones(4, 21)  # a new shape: a new buffer for it alone
    sd["model"]["ids"] = sd["model"]["ids"].to(torch.int32)  # a new dtype, same size in elements
    third = st.stage(sd)
    names = list(sd["model"])
    moved = {names[i] for i, (a, b) in enumerate(zip(first, _ptrs(third))) if a != b and i < len(names)}
    assert moved == {"proj.weight", "ids"} and st.allocations == len(first) + 2
    helpers.assert_tree_equal(_clone(sd), third)


def test_a_held_staged_dict_is_never_overwritten() -> None:
    sd = _state_dict()
    st = PinnedStager(grace_s=0.0)
    held = st.stage(sd)  # as a save still writing holds it
    want = _clone(sd)
    view_only = st.stage(sd)["model"]["emb.weight"][1:3]  # a view of a staged tensor holds its buffers too
    _scramble(sd)
    second = st.stage(sd)
    helpers.assert_tree_equal(want, held)
    helpers.assert_bitwise_equal(want["model"]["emb.weight"][1:3], view_only)
    helpers.assert_tree_equal(_clone(sd), second)
    assert not set(_ptrs(second)) & set(_ptrs(held)) and st.fresh_copies == 2
    del held, view_only, second
    gc.collect()
    sd2 = _clone(sd)
    last = st.stage(sd2)  # nothing alive any more: the latest set is reused
    assert st.fresh_copies == 2
    helpers.assert_tree_equal(sd2, last)


def test_only_the_buffer_under_a_kept_slice_is_replaced() -> None:
    sd = _state_dict()
    st = PinnedStager(grace_s=0.0)
    first = st.stage(sd)
    ptrs = _ptrs(first)
    kept = first["optim"]["state"][0]["exp_avg"][2:5]  # the caller keeps a slice of one staged tensor
    want = kept.clone()
    del first
    _scramble(sd)
    second = st.stage(sd)
    helpers.assert_bitwise_equal(want, kept)
    moved = [i for i, (a, b) in enumerate(zip(ptrs, _ptrs(second))) if a != b]
    names = [id(t) for t in _tensors(sd)]
    assert moved == [names.index(id(sd["optim"]["state"][0]["exp_avg"]))]
    assert st.allocations == len(ptrs) + 1 and st.fresh_copies == 1
    helpers.assert_tree_equal(_clone(sd), second)


def test_close_frees_the_buffers_and_refuses_further_stages() -> None:
    sd = _state_dict()
    st = PinnedStager()
    staged = st.stage(sd)
    freed = weakref.ref(staged["model"]["emb.weight"])
    want = _clone(sd)
    st.close()
    assert st.closed
    helpers.assert_tree_equal(want, staged)  # a save still writing keeps what it was handed
    del staged
    gc.collect()
    assert freed() is None
    with pytest.raises(RuntimeError, match="closed.*create a new PinnedStager"):
        st.stage(sd)
    st.close()  # twice is fine


def test_the_page_lock_is_released_only_with_the_last_tensor_over_the_memory() -> None:
    """The bookkeeping of the CUDA registration (the real cudaHostRegister runs in tests/gpu)."""
    calls: list[tuple[str, int]] = []
    raw = torch.empty(3 * 4096, dtype=torch.uint8)
    skip = -raw.data_ptr() % 4096
    pin_pages(raw.untyped_storage(), skip, 4096, lambda a, n: calls.append(("pin", a)),
              lambda a: calls.append(("unpin", a)))
    address = raw.data_ptr() + skip
    assert calls == [("pin", address)] and address % 4096 == 0
    view = raw[skip:skip + 8].view(torch.float32)
    del raw
    gc.collect()
    assert calls == [("pin", address)]  # a tensor still uses the memory: still locked
    del view
    gc.collect()
    assert calls == [("pin", address), ("unpin", address)]


# ---------------------------------------------------------------------------- two gloo ranks: DTensor, ShardedTensor
def _sharded(world: int) -> Any:
    """A ShardedTensor (rowwise chunks) over the seeded "st" tensor."""
    from torch.distributed._shard import sharded_tensor
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec

    full = helpers.seeded_tensor("st", (9, 4), torch.float16)
    spec = ChunkShardingSpec(dim=0, placements=[f"rank:{r}/cpu" for r in range(world)])
    st = sharded_tensor.empty(spec, 9, 4, dtype=torch.float16, init_rrefs=False)
    for s in st.local_shards():
        (o, _), (n, _) = s.metadata.shard_offsets, s.metadata.shard_sizes
        s.tensor.copy_(full[o:o + n])
    return st


def _dtensor_ranks(rank: int, world: int, root: str) -> None:
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))

    def state() -> dict[str, Any]:
        return {"w": distribute_tensor(helpers.seeded_tensor("w", (7, 6), torch.bfloat16), mesh, [Shard(0)]),
                "r": distribute_tensor(helpers.seeded_tensor("r", (5,), torch.float32), mesh, [Replicate()]),
                "st": _sharded(world), "plain": helpers.seeded_tensor("p", (4,), torch.float8_e4m3fn), "step": 7}

    def local(sd: dict[str, Any]) -> list[torch.Tensor]:
        return [sd["w"].to_local(), sd["r"].to_local(), sd["st"].local_shards()[0].tensor, sd["plain"]]

    sd = state()
    want = local(state())
    st = PinnedStager(grace_s=30.0)
    staged = st.stage(sd)
    assert isinstance(staged["w"], DTensor) and staged["w"].placements == sd["w"].placements
    assert staged["w"].to_local().device.type == "cpu" and staged["w"].shape == sd["w"].shape
    assert isinstance(staged["st"], ShardedTensor) and staged["st"].metadata() == sd["st"].metadata()
    for a, b in zip(local(staged), local(sd)):
        helpers.assert_bitwise_equal(a, b, f"staged rank {rank}")
        assert a.data_ptr() != b.data_ptr()
    del staged, a, b
    for i in range(2):
        path = os.path.join(root, str(i))
        fut = dcp.async_save(sd, storage_writer=MmapWriter(path), async_stager=st)
        for t in local(sd):
            t.view(torch.uint8).bitwise_not_()
        fut.result()
        got = state()
        for t in local(got):
            t.view(torch.uint8).fill_(0x5A)
        dcp.load(got, storage_reader=MmapReader(path))
        for k, a, b in zip(("w", "r", "st", "plain"), local(got), want):
            helpers.assert_bitwise_equal(a, b, f"{k} rank {rank} save {i}")
        want = [t.clone() for t in local(sd)]
    assert st.allocations == 4 and st.fresh_copies == 0, (st.allocations, st.fresh_copies)
    st.close()


@pytest.mark.distributed
def test_dtensors_and_sharded_tensors_on_two_gloo_ranks(tmp_path) -> None:
    helpers.run_distributed(_dtensor_ranks, 2, str(tmp_path))
