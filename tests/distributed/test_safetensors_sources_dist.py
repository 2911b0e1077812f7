"""Hugging Face safetensors directories and SAFETENSORS-format stock DCP loaded into DTensors on 2 and 4 gloo ranks.

The peer is torch's ``HuggingFaceStorageReader`` (how torchtitan starts training from Hugging
Face weights): each directory is loaded by it and by MmapReader into the same DTensor targets
(Shard(0), Shard(1), Replicate over a 1-D mesh), starting as the bitwise complement of the
values, and every rank compares its local shards byte for byte with the peer's and with the
expected region of the full tensor. The directories:

- ``hub``: a Hub layout (two files and ``model.safetensors.index.json``) written in the parent;
- ``hf-dist``: what ``HuggingFaceStorageWriter(save_distributed=True)`` leaves after a save by 2
  ranks of Shard(0) DTensors: one file per rank, each chunk's offsets in ``DCP_SHARDING_INFO``;
  loaded again by the same 2 ranks and resharded onto 4 ranks;
- ``stock-st``: ``FileSystemWriter(serialization_format=SAFETENSORS)`` output of the same save, which
  no stock reader loads: compared with the expected values only.

Each is also loaded with ``read_once=True`` (each stored chunk read on one rank and sent to
the others). Each rank records the files it mapped during each MmapReader load: exactly those holding a
stored chunk that overlaps one of its local shards (from the reader's metadata), so with
Shard(0) on 4 ranks every rank maps one of the two files.
"""

from __future__ import annotations

import json
import os
from typing import Any

import dist_ranks as dr
import helpers
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import SerializationFormat
from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor, init_device_mesh

import mmapckpt.storage.local as local_storage
from mmapckpt import MmapReader

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

#: fqn -> (shape, dtype); 11 rows split 6/5 over 2 ranks and 3/3/3/2 over 4, 32 elements 16/16 and 8 each.
SHAPES: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
    "w": ((11, 20), torch.float32), "v": ((32,), torch.bfloat16), "s": ((12, 6), torch.float8_e4m3fn)}
PLACEMENTS = {"S0": [Shard(0)], "S1": [Shard(1)], "R": [Replicate()]}


def full(fqn: str) -> torch.Tensor:
    return helpers.seeded_tensor(fqn, *SHAPES[fqn])


def _placements(fqn: str, layout: str) -> list[Any]:
    if layout == "S1" and len(SHAPES[fqn][0]) < 2:
        return PLACEMENTS["S0"]
    return PLACEMENTS[layout]


def state_dict(mesh: Any, layout: str, *, complement: bool) -> dict[str, DTensor]:
    out = {}
    for fqn in SHAPES:
        t = full(fqn)
        if complement:
            t = (~t.view(torch.uint8)).view(t.dtype)
        out[fqn] = distribute_tensor(t, mesh, _placements(fqn, layout), src_data_rank=None)  # no scatter: gloo has no fp8
    return out


class Recorded(local_storage.MappedFile):  # type: ignore[misc,name-defined]
    """Records the name of every file mapped in this process."""

    paths: list[str] = []

    def __init__(self, fd: int, path: str, size: int) -> None:
        Recorded.paths.append(os.path.basename(path))
        super().__init__(fd, path, size)


def files_needed(path: str, sd: dict[str, DTensor]) -> set[str]:
    """The files holding a stored chunk that overlaps one of this rank's local shards."""
    md = MmapReader(path).read_metadata()
    need = set()
    for idx, info in md.storage_data.items():
        chunk = next(c for c in md.state_dict_metadata[idx.fqn].chunks if c.offsets == idx.offset)
        dt = sd[idx.fqn]
        local = dt.to_local()
        if local.numel() == 0:
            continue
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(dt.shape, dt.device_mesh, dt.placements)
        if all(o < co + cs and co < o + s for o, s, co, cs in zip(offset, shape, chunk.offsets, chunk.sizes)):
            need.add(os.path.basename(info.relative_path))
    return need


def _load_and_compare(rec: dr.Recorder, mesh: Any, name: str, path: str, layout: str, *, peer: bool,
                      world: int) -> None:
    def check() -> None:
        want = state_dict(mesh, layout, complement=False)
        ours = state_dict(mesh, layout, complement=True)
        Recorded.paths = []
        dcp.load(ours, storage_reader=MmapReader(path))
        mapped = set(Recorded.paths)
        if peer:
            theirs = state_dict(mesh, layout, complement=True)
            dcp.load(theirs, storage_reader=HuggingFaceStorageReader(path))
            for fqn in SHAPES:
                helpers.assert_bitwise_equal(theirs[fqn].to_local(), ours[fqn].to_local(), f"{fqn} vs stock")
        for fqn in SHAPES:
            helpers.assert_bitwise_equal(want[fqn].to_local(), ours[fqn].to_local(), fqn)
        need = files_needed(path, ours)
        assert mapped == need, f"mapped {sorted(mapped)}, needed {sorted(need)}"
        if name == "hf-dist" and layout == "S0" and world == 4:
            assert len(mapped) == 1, mapped  # each rank's rows lie in one of the two files
    rec.run(f"{name}|{layout}", check)

    def read_once() -> None:  # each stored chunk read by one rank and sent to the others that need it
        want, ours = state_dict(mesh, layout, complement=False), state_dict(mesh, layout, complement=True)
        dcp.load(ours, storage_reader=MmapReader(path, read_once=True, read_once_min_share=0.0))
        for fqn in SHAPES:
            helpers.assert_bitwise_equal(want[fqn].to_local(), ours[fqn].to_local(), fqn)
    rec.run(f"{name}|{layout}|read-once", read_once)


def _rank_main(rank: int, world: int, root: str, out: str, phase: str) -> None:
    mesh = init_device_mesh("cpu", (world,))
    local_storage.MappedFile = Recorded  # the rank's own process: every mapping made is recorded
    rec = dr.Recorder(out, phase, rank)
    try:
        hf_dist, stock_st = os.path.join(root, "hf-dist"), os.path.join(root, "stock-st")
        if phase == "two":
            sd = state_dict(mesh, "S0", complement=False)
            rec.run("save|hf-dist", lambda: dcp.save(sd, storage_writer=HuggingFaceStorageWriter(
                hf_dist, save_distributed=True)))
            rec.run("save|stock-st", lambda: dcp.save(sd, storage_writer=FileSystemWriter(
                stock_st, serialization_format=SerializationFormat.SAFETENSORS)))
        for layout in PLACEMENTS:
            _load_and_compare(rec, mesh, "hub", os.path.join(root, "hub"), layout, peer=True, world=world)
            _load_and_compare(rec, mesh, "hf-dist", hf_dist, layout, peer=True, world=world)
            _load_and_compare(rec, mesh, "stock-st", stock_st, layout, peer=False, world=world)
        dist.barrier()
    finally:
        rec.dump()


def check_names(phase: str) -> list[str]:
    saves = ["save|hf-dist", "save|stock-st"] if phase == "two" else []
    return saves + [f"{n}|{lay}{how}" for lay in PLACEMENTS for n in ("hub", "hf-dist", "stock-st")
                    for how in ("", "|read-once")]


# ---------------------------------------------------------------------------- the parent's side
@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> str:
    d = tmp_path_factory.mktemp("hf-dirs")
    hub = d / "hub"
    hub.mkdir()
    files = {"model-00001-of-00002.safetensors": ["w"], "model-00002-of-00002.safetensors": ["v", "s"]}
    for f, names in files.items():
        save_file({n: full(n) for n in names}, str(hub / f), metadata={"format": "pt"})
    (hub / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: f for f, names in files.items() for n in names}}))
    return str(d)


@pytest.fixture(scope="module")
def results(root: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, str]]]:
    out = str(tmp_path_factory.mktemp("hf-dirs-results"))
    helpers.run_distributed(_rank_main, 2, root, out, "two")  # saves, then loads on the same 2 ranks
    helpers.run_distributed(_rank_main, 4, root, out, "four")  # resharded onto 4 ranks
    return {"two": dr.read_results(out, "two", 2), "four": dr.read_results(out, "four", 4)}


def test_the_save_made_one_file_per_rank(root: str, results: Any) -> None:
    assert sorted(n for n in os.listdir(os.path.join(root, "hf-dist")) if n.endswith(".safetensors")) == [
        "shard-00001-model-00001-of-00001.safetensors", "shard-00002-model-00001-of-00001.safetensors"]


CASES = [(p, n) for p in ("two", "four") for n in check_names(p)]


@pytest.mark.parametrize("phase, name", CASES, ids=[f"{p}-{n}" for p, n in CASES])
def test_rank_check(phase: str, name: str, results: dict[str, list[dict[str, str]]]) -> None:
    failed = {r: res.get(name, "not run") for r, res in enumerate(results[phase]) if res.get(name) != "ok"}
    assert not failed, "\n".join(f"rank {r}: {msg}" for r, msg in failed.items())
