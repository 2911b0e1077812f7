"""FastLoadPlanner / FastSavePlanner make exactly the default planners' plans, metadata and loads.

The plans are compared field by field, index hints included (``MetadataIndex.__eq__``
ignores them, so plain ``==`` would not catch a wrong hint), on random state dicts
(hypothesis), on the edge cases the fast paths special-case, and on 2 real gloo ranks
with DTensors saved with one planner and loaded, resharded or not, with the other.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.planner import LoadItemType

import helpers
import strategies
from mmapckpt import FastLoadPlanner, FastSavePlanner, MmapReader, MmapWriter, SafeLoadPlanner, ZeroCopyLoadPlanner
from mmapckpt.dcp.read_paths import _defers_safely
from mmapckpt.format.metadata import METADATA_NAME


# --------------------------------------------------------------------------- plan comparison
def _index(mi: Any) -> tuple:
    return (mi.fqn, None if mi.offset is None else tuple(mi.offset), mi.index)


def _read_items(plan: Any) -> list[tuple]:
    return [(r.type, _index(r.dest_index), tuple(r.dest_offsets), _index(r.storage_index), tuple(r.storage_offsets),
             tuple(r.lengths)) for r in plan.items]


def _write_items(plan: Any) -> list[tuple]:
    return [(w.type, _index(w.index), w.bytes_io_data, w.tensor_data) for w in plan.items]


def _save_plans(planner: Any, sd: Any, ranks: int = 1) -> tuple:
    planner.set_up_planner(sd, None, True)
    local = planner.create_local_plan()
    global_plans, md = planner.create_global_plan([local] * ranks)
    final = planner.finish_plan(global_plans[0])
    return (_write_items(local), local.planner_data, [_write_items(p) for p in global_plans],
            [p.planner_data for p in global_plans], md, _write_items(final))


def _load_plan(planner: Any, sd: Any, md: Any) -> tuple[list[tuple], list[tuple]]:
    planner.set_up_planner(sd, md, True)
    plan = planner.finish_plan(planner.create_global_plan([planner.create_local_plan()])[0])
    targets = []
    for r in plan.items:
        if r.type != LoadItemType.BYTE_IO:
            t = planner.resolve_tensor(r)
            targets.append((t.data_ptr(), tuple(t.shape), t.stride(), t.dtype))
    return _read_items(plan), targets


def _same_plans(sd_factory: Any, ranks: int = 1) -> Any:
    default, fast = _save_plans(DefaultSavePlanner(), sd_factory(), ranks), _save_plans(FastSavePlanner(), sd_factory(), ranks)
    assert fast == default
    md = default[4]
    targets = sd_factory()
    assert _load_plan(FastLoadPlanner(), targets, md) == _load_plan(DefaultLoadPlanner(), targets, md)
    return md


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(strategies.state_dicts(), st.integers(1, 3))
def test_plans_equal_the_default_planners_on_random_state_dicts(sd: dict[str, Any], ranks: int) -> None:
    _same_plans(lambda: sd, ranks)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(strategies.tensor_state_dicts())
def test_flat_plain_state_dicts_take_the_fast_path_and_plan_the_same(sd: dict[str, Any]) -> None:
    flat = strategies.flatten(sd)  # {str: plain tensor}: set_up_planner's fast path too
    md = _same_plans(lambda: dict(flat))
    assert set(md.state_dict_metadata) == set(flat)


def _edge_cases() -> dict[str, Any]:
    return {
        "scalar": torch.tensor(3.5), "empty": torch.zeros(0, 4), "empty1": torch.zeros(0),
        "param": torch.nn.Parameter(torch.randn(3, 2)), "frozen": torch.nn.Parameter(torch.randn(2), requires_grad=False),
        "grad": torch.randn(5, requires_grad=True), "t": torch.randn(4, 3).t(), "step": 7, "name": "x",
        "nested": {"a": torch.arange(6).view(2, 3), "lst": [torch.ones(2, dtype=torch.bfloat16), 1.5]},
    }


def test_edge_cases_plan_the_same_flat_and_nested() -> None:
    _same_plans(_edge_cases)
    _same_plans(_edge_cases, ranks=2)  # dedup across ranks
    flat = {k: v for k, v in _edge_cases().items() if isinstance(v, torch.Tensor)}
    md = _same_plans(lambda: dict(flat))
    # the fast path plans no read for a zero-size tensor (DCP's sweep finds no overlap) and one for a 0-d one
    _, default_targets = _load_plan(DefaultLoadPlanner(), dict(flat), md)
    items, _ = _load_plan(FastLoadPlanner(), dict(flat), md)
    assert {i[1][0] for i in items} == set(flat) - {"empty", "empty1"}
    assert len(default_targets) == len(items)


def test_partial_load_missing_keys_and_size_mismatch_behave_as_the_default() -> None:
    md = _save_plans(DefaultSavePlanner(), {"a": torch.zeros(4), "b": torch.zeros(2, 2)})[4]
    extra = {"a": torch.zeros(4), "z": torch.zeros(1)}
    for allow in (True,):
        got = [_load_plan(cls(allow_partial_load=allow), dict(extra), md)[0] for cls in (DefaultLoadPlanner, FastLoadPlanner)]
        assert got[0] == got[1] and [i[1][0] for i in got[1]] == ["a"]
    for bad, exc in (({"z": torch.zeros(1)}, RuntimeError), ({"a": torch.zeros(5)}, ValueError),
                     ({"b": torch.zeros(4)}, ValueError)):
        msgs = []
        for cls in (DefaultLoadPlanner, FastLoadPlanner):
            with pytest.raises(exc) as e:
                _load_plan(cls(), dict(bad), md)
            msgs.append(str(e.value))
        assert msgs[0] == msgs[1]


def _shard_plans(overlap: bool) -> list[Any]:
    """Two ranks' plans holding the two halves (or, if ``overlap``, overlapping parts) of one DTensor."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

    props = TensorProperties.create_from_tensor(torch.zeros(1))
    plans = []
    for rank, (off, size) in enumerate(((0, 2), (1 if overlap else 2, 2))):
        chunk = ChunkStorageMetadata(offsets=torch.Size([off]), sizes=torch.Size([size]))
        items = [WriteItem(index=MetadataIndex("w", chunk.offsets), type=WriteItemType.SHARD,
                           tensor_data=TensorWriteData(chunk=chunk, properties=props, size=torch.Size([4])))]
        if rank == 0:
            items.append(WriteItem(index=MetadataIndex("step"), type=WriteItemType.BYTE_IO))
        plans.append(SavePlan(items, planner_data={"w": ("w",), "step": ("step",)}))
    return plans


def test_global_save_plan_of_shards_from_several_ranks_equals_the_default() -> None:
    got = []
    for cls in (DefaultSavePlanner, FastSavePlanner):
        planner = cls()
        planner.set_up_planner({}, None, True)
        plans, md = planner.create_global_plan(_shard_plans(False))
        got.append(([_write_items(p) for p in plans], md))
    assert got[0] == got[1]
    assert [p[0][1][2] for p in got[1][0]] == [0, 1]  # the index hints: each chunk's place in the metadata
    msgs = []
    for cls in (DefaultSavePlanner, FastSavePlanner):
        planner = cls()
        planner.set_up_planner({}, None, True)
        with pytest.raises(ValueError) as e:
            planner.create_global_plan(_shard_plans(True))
        msgs.append(str(e.value))
    assert msgs[0] == msgs[1] and "overlapping chunks" in msgs[1]


def test_load_planners_keep_the_readers_direct_reads() -> None:
    for cls in (FastLoadPlanner, SafeLoadPlanner, ZeroCopyLoadPlanner):
        assert issubclass(cls, FastLoadPlanner) and issubclass(cls, DefaultLoadPlanner)
        assert _defers_safely(cls()), cls


def test_resolve_tensor_honours_a_subclass_lookup_or_transform(tmp_path) -> None:
    """FastLoadPlanner.resolve_tensor resolves in one call only while lookup_tensor and
    transform_tensor are its own: a subclass's override is still the one that decides."""
    spare = torch.full((4,), 7.0)

    class Redirect(FastLoadPlanner):
        def lookup_tensor(self, index: Any) -> torch.Tensor:
            return spare

    class Halve(FastLoadPlanner):
        def transform_tensor(self, read_item: Any, tensor: torch.Tensor) -> Any:
            return tensor[:2]

    dcp.save({"w": torch.arange(4.0)}, storage_writer=MmapWriter(str(tmp_path)), no_dist=True)
    md = MmapReader(str(tmp_path)).read_metadata()
    for cls, want in ((FastLoadPlanner, "w"), (Redirect, "spare"), (Halve, "half")):
        sd = {"w": torch.zeros(4)}
        planner = cls()
        planner.set_up_planner(sd, md, True)
        (item,) = planner.create_local_plan().items
        got = planner.resolve_tensor(item)
        expect = {"w": sd["w"], "spare": spare, "half": sd["w"][:2]}[want]
        assert (got.data_ptr(), got.shape) == (expect.data_ptr(), expect.shape), cls


# --------------------------------------------------------------------------- through dcp.save / dcp.load
def _doc(path: str) -> dict[str, Any]:
    with open(os.path.join(path, METADATA_NAME), "rb") as f:
        doc = json.loads(f.read()[24:])
    doc.pop("storage_meta")  # checkpoint id and save id: per save
    doc["table"].pop("files")  # the file names carry the save id
    return doc


def test_checkpoints_and_loads_equal_the_default_planners(tmp_path) -> None:
    sd = _edge_cases()
    sd["many"] = {f"w{i}": torch.randn(3, i % 4 + 1) for i in range(40)}
    for name, planner in (("default", DefaultSavePlanner()), ("fast", FastSavePlanner())):
        dcp.save(sd, storage_writer=MmapWriter(str(tmp_path / name)), planner=planner, no_dist=True)
    assert _doc(str(tmp_path / "fast")) == _doc(str(tmp_path / "default"))
    for path in ("default", "fast"):
        for planner in (DefaultLoadPlanner(), FastLoadPlanner(), SafeLoadPlanner()):
            got = strategies.fresh_like(sd, 0xA5)
            dcp.load(got, storage_reader=MmapReader(str(tmp_path / path)), planner=planner, no_dist=True)
            helpers.assert_tree_equal(got, sd)
    flat = {f"t{i}": torch.randn(i % 5, 3) for i in range(30)}
    dcp.save(flat, storage_writer=MmapWriter(str(tmp_path / "flat")), planner=FastSavePlanner(), no_dist=True)
    got = strategies.fresh_like(flat, 0xA5)
    dcp.load(got, storage_reader=MmapReader(str(tmp_path / "flat")), planner=FastLoadPlanner(), no_dist=True)
    helpers.assert_tree_equal(got, flat)


# --------------------------------------------------------------------------- 2 gloo ranks, DTensors
_LAYOUTS = {"same": ("S0", "S1", "R", "S0"), "resharded": ("S1", "R", "S0", "-")}
_SHAPES = ((8, 6), (5, 7), (4, 4), (3,))


def _dtensors(mesh: Any, specs: tuple[str, ...], fill: bool) -> dict[str, Any]:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    out: dict[str, Any] = {}
    for i, (shape, spec) in enumerate(zip(_SHAPES, specs)):
        full = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).view(shape) * (i + 1) if fill else torch.full(shape, -1.0)
        if spec == "-":
            out[f"t{i}"] = full
        else:
            placement = Replicate() if spec == "R" else Shard(int(spec[1]))
            if spec.startswith("S") and placement.dim >= len(shape):
                placement = Shard(0)
            out[f"t{i}"] = distribute_tensor(full, mesh, [placement], src_data_rank=None)
    out["step"] = 3
    return out


def _ranks(rank: int, world: int, root: str, save_fast: bool) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh("cpu", (world,))
    saved = _dtensors(mesh, _LAYOUTS["same"], True)
    dcp.save(saved, storage_writer=MmapWriter(root), planner=FastSavePlanner() if save_fast else DefaultSavePlanner())
    md = MmapReader(root).read_metadata()
    for layout, specs in _LAYOUTS.items():
        plans = [_load_plan(cls(), _dtensors(mesh, specs, False), md)[0] for cls in (DefaultLoadPlanner, FastLoadPlanner)]
        assert plans[0] == plans[1], (rank, layout)
        got = _dtensors(mesh, specs, False)
        dcp.load(got, storage_reader=MmapReader(root), planner=DefaultLoadPlanner() if save_fast else FastLoadPlanner())
        want = _dtensors(mesh, specs, True)
        for k, v in want.items():
            if isinstance(v, DTensor):
                helpers.assert_bitwise_equal(got[k].to_local(), v.to_local(), f"{layout} {k} rank {rank}")
            elif isinstance(v, torch.Tensor):
                helpers.assert_bitwise_equal(got[k], v, f"{layout} {k} rank {rank}")
            else:
                assert got[k] == v


@pytest.mark.distributed
@pytest.mark.parametrize("save_fast", [True, False])
def test_dtensors_on_two_ranks_save_with_one_planner_load_with_the_other(tmp_path, save_fast: bool) -> None:
    helpers.run_distributed(_ranks, 2, str(tmp_path / "ckpt"), save_fast)
