"""Read-once planning and piece geometry, without processes: hypothesis-generated layouts.

``plan_read_once`` gets synthetic LoadPlans of 2-6 ranks over records of random sizes,
each needed by a random set of ranks; ``pieces`` gets random chunk shapes, element sizes
and piece sizes. The multi-rank loads themselves are in test_read_once.py.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

from mmapckpt.dcp.deliver import pieces
from mmapckpt.dcp.read_once import LocalPlanInfo, ReadOnceOptions, ReadOnceSchedule, plan_read_once

PROPERTY = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64, 16: torch.complex128}


# ---------------------------------------------------------------------------- pieces
@PROPERTY
@given(shape=st.lists(st.integers(0, 6), min_size=0, max_size=4), itemsize=st.sampled_from(sorted(DTYPES)),
       piece_bytes=st.integers(1, 400))
def test_pieces_cover_the_chunk_once_in_order_as_hypercubes(shape: list[int], itemsize: int,
                                                             piece_bytes: int) -> None:
    dtype = DTYPES[itemsize]
    numel = 1
    for s in shape:
        numel *= s
    chunk = torch.arange(numel, dtype=torch.int64).to(dtype).reshape(shape)
    flat = chunk.reshape(-1).view(torch.uint8)
    end = 0
    for off, n, starts, lengths in pieces(tuple(shape), itemsize, piece_bytes):
        assert off == end and n > 0
        assert n <= max(piece_bytes, itemsize)
        cube = chunk
        for d, (a, m) in enumerate(zip(starts, lengths)):
            cube = cube.narrow(d, a, m)
        assert cube.numel() * itemsize == n
        assert torch.equal(cube.contiguous().reshape(-1).view(torch.uint8), flat[off:off + n])
        end += n
    assert end == numel * itemsize


def test_a_chunk_that_fits_is_one_piece() -> None:
    assert list(pieces((4, 8), 4, 1 << 20)) == [(0, 128, (0, 0), (4, 8))]


def test_rows_bigger_than_a_piece_are_split_along_the_next_dimension() -> None:
    got = list(pieces((2, 10), 4, 16))  # a row is 40 bytes: 4 elements per piece
    assert [p[0] for p in got] == [0, 16, 32, 40, 56, 72]
    assert got[2] == (32, 8, (0, 8), (1, 2))


# ---------------------------------------------------------------------------- planning
def _records(lengths: list[int]) -> dict[MetadataIndex, _StorageInfo]:
    out, offset = {}, 0
    for i, n in enumerate(lengths):
        out[MetadataIndex(f"t{i}", torch.Size([0]))] = _StorageInfo(f"__{i % 2}_0.distcp", offset, n)
        offset += n
    return out


def _item(idx: MetadataIndex, n: int) -> ReadItem:
    size = torch.Size([n])
    return ReadItem(LoadItemType.TENSOR, MetadataIndex(idx.fqn, torch.Size([0])), torch.Size([0]), idx,
                    torch.Size([0]), size)


def _plans(storage: dict[MetadataIndex, _StorageInfo], needs: list[set[int]], world: int,
           hosts: list[str] | None = None) -> list[LoadPlan]:
    plans = []
    for r in range(world):
        items = [_item(idx, storage[idx].length) for idx, need in zip(storage, needs) if r in need]
        plans.append(LoadPlan(items, storage_data=LocalPlanInfo(hosts[r] if hosts else "h")))
    return plans


@st.composite
def layouts(draw: st.DrawFn) -> tuple[int, list[int], list[set[int]]]:
    world = draw(st.integers(2, 6))
    n = draw(st.integers(1, 12))
    lengths = draw(st.lists(st.integers(1, 10_000), min_size=n, max_size=n))
    needs = draw(st.lists(st.sets(st.integers(0, world - 1), min_size=1), min_size=n, max_size=n))
    return world, lengths, needs


@PROPERTY
@given(layout=layouts(), min_share=st.sampled_from([0.0, 0.25, 0.5, 1.0]))
def test_each_shared_record_gets_exactly_one_reader_that_needs_it(layout: tuple[int, list[int], list[set[int]]],
                                                                  min_share: float) -> None:
    world, lengths, needs = layout
    storage = _records(lengths)
    plans = _plans(storage, needs, world)
    out = plan_read_once(plans, storage, min_share)
    assert [p.items for p in out] == [p.items for p in plans]  # the items are never touched
    shared = {idx: need for idx, need in zip(storage, needs) if len(need) > 1}
    requested = sum(n * len(need) for n, need in zip(lengths, needs))
    share_bytes = sum(storage[idx].length * len(need) for idx, need in shared.items())
    if not shared or share_bytes < min_share * requested:
        assert all(p.storage_data is None for p in out)  # everyone falls back, nobody keeps host info
        return
    schedules = [p.storage_data for p in out]
    assert all(isinstance(s, ReadOnceSchedule) for s in schedules)
    assert all(s == schedules[0] for s in schedules)  # one schedule, so one sequence of collectives
    sched = schedules[0]
    assert sched.world == world
    assert {rec.index for rec in sched.records} == set(shared)
    for rec in sched.records:
        assert set(rec.ranks) == shared[rec.index] and rec.reader in rec.ranks
        assert list(rec.ranks) == sorted(rec.ranks)
    order = [(storage[r.index].relative_path, storage[r.index].offset) for r in sched.records]
    assert order == sorted(order)  # sent in file order
    own = [sum(storage[idx].length for idx, need in zip(storage, needs) if need == {r}) for r in range(world)]
    for r in range(world):
        assert sched.reads_per_rank[r] == own[r] + sum(storage[x.index].length for x in sched.records if x.reader == r)


@PROPERTY
@given(world=st.integers(2, 6), lengths=st.lists(st.integers(1, 5000), min_size=1, max_size=20))
def test_a_fully_replicated_load_spreads_bytes_evenly(world: int, lengths: list[int]) -> None:
    storage = _records(lengths)
    out = plan_read_once(_plans(storage, [set(range(world))] * len(lengths), world), storage)
    reads = out[0].storage_data.reads_per_rank
    assert sum(reads) == sum(lengths)
    assert max(reads) - min(reads) <= max(lengths)  # biggest first, each to the least loaded rank


def test_readers_are_spread_over_nodes_first() -> None:
    storage = _records([1000, 1000])
    plans = _plans(storage, [{0, 1, 2, 3}] * 2, 4, hosts=["a", "a", "b", "b"])
    sched = plan_read_once(plans, storage)[0].storage_data
    hosts = {["a", "a", "b", "b"][rec.reader] for rec in sched.records}
    assert hosts == {"a", "b"}


def test_disjoint_shards_fall_back_to_the_plain_plans() -> None:
    storage = _records([1000, 1000, 1000, 8])
    plans = _plans(storage, [{0}, {1}, {2}, {0, 1, 2}], 3)  # tensor parallel, one small replicated norm
    assert all(p.storage_data is None for p in plan_read_once(plans, storage))
    forced = plan_read_once(plans, storage, min_share=0.0)
    assert [r.index.fqn for r in forced[0].storage_data.records] == ["t3"]


def test_a_single_plan_never_uses_read_once() -> None:
    storage = _records([10, 20])
    plans = [LoadPlan([_item(i, storage[i].length) for i in storage], storage_data=LocalPlanInfo("h"))]
    assert plan_read_once(plans, storage, 0.0)[0].storage_data is None


def test_stream_transformed_records_stay_on_the_plain_path() -> None:
    storage = _records([1000, 1000])
    first = next(iter(storage))
    storage[first].transform_descriptors = ["zstd"]
    out = plan_read_once(_plans(storage, [{0, 1}, {0, 1}], 2), storage, 0.0)
    assert [r.index.fqn for r in out[0].storage_data.records] == ["t1"]


@pytest.mark.parametrize("kw", [{"piece_bytes": 0}, {"min_share": -0.1}, {"min_share": 1.5}])
def test_options_are_checked(kw: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        ReadOnceOptions(True, None, **kw)  # type: ignore[arg-type]

