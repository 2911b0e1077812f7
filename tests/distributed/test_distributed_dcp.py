"""Multi-rank dcp.save / dcp.load with MmapWriter and MmapReader over real gloo process groups.

Three spawns (2, 4, then 2 ranks; see dist_ranks.PHASES) save the same DTensor-sharded,
replicated, plain and non-tensor state dict with MmapWriter, with the stock
FileSystemWriter and with dcp.async_save, and load every checkpoint back on 2 and 4
ranks under other shardings (4 -> 2, 2 -> 4, Shard(0) <-> Shard(1), onto a 2-D mesh)
with MmapReader and, for stock checkpoints, with the stock FileSystemReader. Every
rank compares every local shard bit for bit with the expected data and the loads with
each other; each such check is reported here as its own test. The checkpoints are then
loaded in this process (N -> 1, no_dist) and inspected: file names, which rank wrote
which chunk, and the raw bytes at each storage record's offset.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

import dist_ranks as dr
import helpers
from mmapckpt import MmapReader
from mmapckpt.reading.shard import Shard

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(300)]

#: checkpoint dir -> (world size it was saved with, MmapWriter thread_count, layout name); mmapckpt ones.
MMAP_CKPTS = {"m2": (2, 2, "save"), "a2": (2, 1, "save"), "m4": (4, 1, "save"), "m4_2d": (4, 1, "mesh2d")}
NON_TENSOR_FQNS = {"step", "meta.name", "meta.lr", "meta.betas"}


# ---------------------------------------------------------------------------- the spawns
@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("dist-ckpts"))


def _spawn(phase: str, root: str, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, str]]:
    out = str(tmp_path_factory.mktemp(f"results-{phase}"))
    world = dr.PHASES[phase]["world"]
    helpers.run_distributed(dr.run_phase, world, phase, root, out)
    return dr.read_results(out, phase, world)


@pytest.fixture(scope="module")
def two_save(root: str, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, str]]:
    return _spawn("two_save", root, tmp_path_factory)


@pytest.fixture(scope="module")
def four(root: str, two_save: Any, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, str]]:
    return _spawn("four", root, tmp_path_factory)  # loads the 2-rank checkpoints too


@pytest.fixture(scope="module")
def two_load(root: str, four: Any, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, str]]:
    return _spawn("two_load", root, tmp_path_factory)


# ---------------------------------------------------------------------------- checks run on the ranks
@pytest.mark.parametrize("phase", list(dr.PHASES))
def test_every_rank_ran_every_check(phase: str, request: pytest.FixtureRequest) -> None:
    results = request.getfixturevalue(phase)
    for rank, res in enumerate(results):
        assert list(res) == dr.check_names(phase), f"rank {rank} recorded other checks than planned"


@pytest.mark.parametrize("phase,check", [(p, c) for p in dr.PHASES for c in dr.check_names(p)])
def test_rank_check(phase: str, check: str, request: pytest.FixtureRequest) -> None:
    results = request.getfixturevalue(phase)
    failed = {r: res.get(check, "not run") for r, res in enumerate(results) if res.get(check) != "ok"}
    assert not failed, "\n".join(f"rank {r}: {msg}" for r, msg in failed.items())


# ---------------------------------------------------------------------------- N ranks -> 1 process
@pytest.mark.parametrize("ckpt,reader", [("m4", "mmap"), ("m4", "mmap-mapped"), ("s4", "mmap"), ("s4", "stock"),
                                         ("m2", "mmap"), ("s2", "mmap"), ("s2", "stock"), ("a2", "mmap"),
                                         ("m4_2d", "mmap")])
def test_single_process_load_of_full_tensors(ckpt: str, reader: str, root: str, four: Any) -> None:
    sd = dr.load_into(os.path.join(root, ckpt), reader, None, dr.PLAIN, no_dist=True)
    dr.check_state_dict(sd, None, dr.PLAIN)


def test_test_data_holds_special_values() -> None:
    """The data these tests compare really holds -0.0 and NaNs in every float dtype, and valid bools."""
    for fqn, (_, dtype) in dr.TENSORS.items():
        t = dr.full_tensor(fqn)
        assert t.dtype == dtype and t.numel() > 0
        if dtype.is_floating_point:
            f = t.float()
            assert bool(torch.isnan(f).any()), fqn
            assert bool(((f == 0) & torch.signbit(f)).any()), f"{fqn}: no -0.0"
    assert not bool((dr.full_tensor("mask").view(torch.uint8) > 1).any())


# ---------------------------------------------------------------------------- the files written
def _shard_headers(path: str) -> dict[str, Shard]:
    return {n: Shard(os.path.join(path, n)) for n in sorted(os.listdir(path)) if n.endswith(".distcp")}


def _rank_chunk(shape: tuple[int, ...], dim: int, world: int, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(offsets, sizes) of ``rank``'s Shard(dim) chunk: torch.chunk's split, as DTensor documents."""
    sizes = [c.shape[dim] for c in torch.empty(shape, device="meta").chunk(world, dim)]
    sizes += [0] * (world - len(sizes))
    off = [0] * len(shape)
    off[dim] = sum(sizes[:rank])
    size = list(shape)
    size[dim] = sizes[rank]
    return tuple(off), tuple(size)


@pytest.mark.parametrize("ckpt", list(MMAP_CKPTS))
def test_one_file_per_rank_per_bucket(ckpt: str, root: str, four: Any) -> None:
    world, threads, _ = MMAP_CKPTS[ckpt]
    want = {".metadata"} | {f"__{r}_{i}.distcp" for r in range(world) for i in range(threads)}
    assert set(os.listdir(os.path.join(root, ckpt))) == want


@pytest.mark.parametrize("ckpt", [c for c, (_, _, layout) in MMAP_CKPTS.items() if layout == "save"])
def test_each_rank_wrote_only_its_own_chunks(ckpt: str, root: str, four: Any) -> None:
    world, _, _ = MMAP_CKPTS[ckpt]
    path = os.path.join(root, ckpt)
    md = MmapReader(path).read_metadata()
    where: dict[tuple[str, Any], str] = {}
    for name, shard in _shard_headers(path).items():
        rank = int(name[2:].split("_")[0])
        for e in shard.header.entries:
            assert e.key not in where, f"{e.label} is in both {where[e.key]} and {name}"
            where[e.key] = name
            if e.chunk_offsets is None:
                assert e.fqn in NON_TENSOR_FQNS, f"{name}: unexpected bytes entry {e.fqn}"
                continue
            shape, spec = dr.TENSORS[e.fqn][0], dr.SAVE[e.fqn]
            if spec in ("R", "-"):  # replicated and plain tensors: one whole copy, written once
                assert (e.chunk_offsets, e.shape) == ((0,) * len(shape), shape), f"{name}: {e.label}"
            elif 0 not in e.shape:  # empty chunks of different ranks coincide and are deduplicated
                assert (e.chunk_offsets, e.shape) == _rank_chunk(shape, int(spec[1:]), world, rank), \
                    f"{name} holds {e.label} {e.shape}, which is not rank {rank}'s chunk"
    # every rank's non-empty chunks are in that rank's files, and nothing else is anywhere
    for fqn, spec in dr.SAVE.items():
        if spec.startswith("S"):
            for r in range(world):
                off, size = _rank_chunk(dr.TENSORS[fqn][0], int(spec[1:]), world, r)
                if 0 not in size:
                    assert where.get((fqn, off), "").startswith(f"__{r}_"), f"{fqn}@{list(off)} of rank {r}"
    keys = {(i.fqn, None if i.offset is None else tuple(i.offset)) for i in md.storage_data}
    assert keys == set(where)
    assert {k[0] for k in keys} == set(dr.TENSORS) | NON_TENSOR_FQNS


@pytest.mark.parametrize("ckpt", list(MMAP_CKPTS))
def test_storage_records_point_at_the_raw_tensor_bytes(ckpt: str, root: str, four: Any) -> None:
    path = os.path.join(root, ckpt)
    md = MmapReader(path).read_metadata()
    headers = _shard_headers(path)
    n_tensors = 0
    for idx, info in md.storage_data.items():
        e = headers[info.relative_path].entry(idx.fqn, None if idx.offset is None else tuple(idx.offset))
        assert (info.offset, info.length) == (e.offset, e.length), e.label
        assert info.offset % 64 == 0, f"{e.label} at {info.offset}"
        if e.chunk_offsets is None:
            continue
        n_tensors += 1
        chunk = dr.full_tensor(idx.fqn)
        for d, (o, s) in enumerate(zip(e.chunk_offsets, e.shape)):
            chunk = chunk.narrow(d, o, s)
        with open(os.path.join(path, info.relative_path), "rb") as f:
            f.seek(info.offset)
            raw = f.read(info.length)
        assert raw == helpers.tensor_bytes(chunk), f"{ckpt}/{info.relative_path}: bytes of {e.label}"
    assert n_tensors >= len(dr.TENSORS)


@pytest.mark.parametrize("mine,stock", [("m4", "s4"), ("m2", "s2")])
def test_metadata_matches_the_stock_writers(mine: str, stock: str, root: str, four: Any) -> None:
    a = MmapReader(os.path.join(root, mine)).read_metadata().state_dict_metadata
    b = FileSystemReader(os.path.join(root, stock)).read_metadata().state_dict_metadata
    assert set(a) == set(b) == set(dr.TENSORS) | NON_TENSOR_FQNS
    for fqn in a:
        assert type(a[fqn]) is type(b[fqn]), fqn
        if isinstance(a[fqn], BytesStorageMetadata):
            continue
        assert isinstance(a[fqn], TensorStorageMetadata)
        assert a[fqn].size == b[fqn].size and a[fqn].properties.dtype == b[fqn].properties.dtype, fqn
        chunks = lambda m: sorted((tuple(c.offsets), tuple(c.sizes)) for c in m.chunks)  # noqa: E731
        assert chunks(a[fqn]) == chunks(b[fqn]), fqn
