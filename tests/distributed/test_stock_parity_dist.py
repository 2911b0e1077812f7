"""Stock parity on 2 gloo ranks: sharded tensors, DTensors and resharding on load, stock and ours as peers.

The multi-rank behaviours of PyTorch's own filesystem checkpoint tests
(test/distributed/checkpoint/test_file_system_checkpoint{,_cpu}.py), written here
independently and run with every writer/reader pair (stock/stock, the reference;
mmap/mmap; stock writer with MmapReader):

- ShardedTensors (ChunkShardingSpec rowwise, colwise and with more chunks than ranks,
  EnumerableShardingSpec with uneven rows and 2-D blocks) and DTensors (Shard(0), Shard(1),
  Replicate) saved by 2 ranks and loaded under every other layout: the same one, another
  sharding spec, rowwise to colwise, other chunk counts, ShardedTensor <-> DTensor, and
  sharded <-> plain tensor in both directions within one state dict (one entry goes from
  sharded to plain while the other goes from plain to sharded);
- tensors with non-tensor blobs (lists, strings, BytesIO, a Stateful);
- state dicts whose keys come in another order on each rank, and another at load;
- overwrite=True (the second state loads) and overwrite=False (every failure is a
  RuntimeError with "Checkpoint already exists"; ours an mmapckpt.CheckpointExistsError);
- the 2-rank checkpoints loaded in this one process as plain tensors (2 ranks -> 1).

One spawn runs every check on both ranks (``_rank_main``); each records its outcome
(tests/distributed/dist_ranks.Recorder) and is reported here as its own test. Load
targets start as the bitwise complement of the expected values, and every rank compares
each of its local shards byte for byte with the expected region of the full tensor.
"""

from __future__ import annotations

import io
import os
import zlib
from typing import Any

import dist_ranks as dr
import helpers
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from strategies import tensor_from_bytes
from torch.distributed._shard import sharded_tensor
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import TensorProperties
from torch.distributed._shard.sharding_spec import (
    ChunkShardingSpec,
    EnumerableShardingSpec,
    ShardMetadata,
)
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import (
    DTensor,
    Replicate,
    Shard,
    distribute_tensor,
    init_device_mesh,
)

import mmapckpt

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

WORLD = 2
WRITERS: dict[str, Any] = {"stock": FileSystemWriter, "mmap": mmapckpt.MmapWriter}
PAIRS = [("stock", "stock"), ("mmap", "mmap"), ("stock", "mmap")]


def _pair_id(pair: tuple[str, str]) -> str:
    return f"{pair[0]}-writer-{pair[1]}-reader"


def _reader(kind: str, path: str) -> Any:
    return mmapckpt.MmapReader(path) if kind == "mmap" else FileSystemReader(path)


# ---------------------------------------------------------------------------- the tensors and their layouts
#: fqn -> (shape, dtype): "w" is 2-D with 11 rows (uneven over 2 and 4 chunks), "v" 1-D.
SHAPES: dict[str, tuple[tuple[int, ...], torch.dtype]] = {"w": ((11, 20), torch.float32), "v": ((30,), torch.bfloat16)}


def _shards(*blocks: tuple[list[int], list[int], int]) -> EnumerableShardingSpec:
    return EnumerableShardingSpec([ShardMetadata(shard_offsets=o, shard_sizes=s, placement=f"rank:{r}/cpu")
                                   for o, s, r in blocks])


def _chunks(dim: int, ranks: list[int]) -> ChunkShardingSpec:
    return ChunkShardingSpec(dim=dim, placements=[f"rank:{r}/cpu" for r in ranks])


#: ShardedTensor specs by name: rowwise and colwise chunks, more chunks than ranks, uneven
#: enumerable rows (rank 1 first), 2-D blocks; for "w" (11 x 20) and "v" (30).
ST_SPECS: dict[str, Any] = {
    "row2": _chunks(0, [0, 1]),
    "row4": _chunks(0, [0, 1, 1, 0]),
    "row4b": _chunks(0, [1, 0, 0, 1]),
    "col2": _chunks(1, [1, 0]),
    "rows5": _shards(([0, 0], [2, 20], 0), ([2, 0], [1, 20], 1), ([3, 0], [3, 20], 0), ([6, 0], [4, 20], 1),
                     ([10, 0], [1, 20], 0)),
    "rows2": _shards(([0, 0], [8, 20], 1), ([8, 0], [3, 20], 0)),
    "blocks": _shards(([0, 0], [5, 7], 1), ([0, 7], [5, 13], 0), ([5, 0], [6, 20], 1)),
    "v7": _shards(([0], [7], 1), ([7], [23], 0)),
    "v12": _shards(([0], [12], 0), ([12], [18], 1)),
}

#: (layout of "w", layout of "v"), by name. A layout: "st:<spec>" (ShardedTensor), "dt:S0"/"dt:S1"/"dt:R"
#: (DTensor on a 1-D mesh of the 2 ranks) or "plain" (a whole, ordinary tensor on every rank).
COMBOS: dict[str, tuple[str, str]] = {
    "st-row2.plain": ("st:row2", "plain"),
    "st-row4.st-v7": ("st:row4", "st:v7"),
    "st-col2.dt-S0": ("st:col2", "dt:S0"),
    "st-rows5.st-row2": ("st:rows5", "st:row2"),
    "st-rows2.dt-R": ("st:rows2", "dt:R"),
    "st-blocks.st-v12": ("st:blocks", "st:v12"),
    "dt-S0.st-row4b": ("dt:S0", "st:row4b"),
    "dt-S1.st-v7": ("dt:S1", "st:v7"),
    "dt-R.st-row2": ("dt:R", "st:row2"),
    "plain.st-v12": ("plain", "st:v12"),
}
#: Saved with 2 writer threads (the others with 1), as the stock tests run thread_count 1 and 2.
TWO_THREADS = {"st-row4.st-v7", "st-rows5.st-row2", "st-blocks.st-v12", "dt-S1.st-v7", "plain.st-v12"}
#: Saved with single_file_per_rank=False (a file per item; the others one file per rank and thread).
FILE_PER_ITEM = {"st-col2.dt-S0", "st-blocks.st-v12", "dt-R.st-row2"}


def _save_options(combo: str) -> dict[str, Any]:
    return {"thread_count": 2 if combo in TWO_THREADS else 1, "single_file_per_rank": combo not in FILE_PER_ITEM}


def full_tensor(fqn: str) -> torch.Tensor:
    """Seeded random bytes as ``fqn``'s dtype, with -0.0 and NaN payloads planted."""
    shape, dtype = SHAPES[fqn]
    numel = 1
    for s in shape:
        numel *= s
    size = dtype.itemsize
    g = torch.Generator().manual_seed(zlib.crc32(fqn.encode()))
    raw = bytearray(torch.randint(0, 256, (numel * size,), dtype=torch.uint8, generator=g).numpy().tobytes())
    for j, pat in enumerate([bytes(size - 1) + b"\x80", b"\xff" * size, b"\x03" + b"\xff" * (size - 2) + b"\x7f"]):
        i = (j * 37) % numel
        raw[i * size:(i + 1) * size] = pat  # -0.0, NaNs (spread over rows)
    return tensor_from_bytes(bytes(raw), dtype, shape)


def _region(t: torch.Tensor, offsets: Any, sizes: Any) -> torch.Tensor:
    for d, (o, s) in enumerate(zip(offsets, sizes)):
        t = t.narrow(d, o, s)
    return t


def _placements(arg: str) -> list[Any]:
    return [Replicate() if arg == "R" else Shard(int(arg[1:]))]


def _my_st_shards(fqn: str, spec: str, rank: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    shape, dtype = SHAPES[fqn]
    md = ST_SPECS[spec].build_metadata(torch.Size(shape), TensorProperties(dtype=dtype))
    return sorted((tuple(m.shard_offsets), tuple(m.shard_sizes)) for m in md.shards_metadata
                  if m.placement.rank() == rank)


def build(fqn: str, layout: str, mesh: Any, sentinel: bool) -> Any:
    """``fqn`` in ``layout``: the expected values, or (``sentinel``) their bitwise complement."""
    full = full_tensor(fqn)
    if sentinel:
        full = dr.complement(full)
    kind, _, arg = layout.partition(":")
    if kind == "plain":
        return full
    if kind == "dt":
        return distribute_tensor(full, mesh, _placements(arg), src_data_rank=None)
    shape, dtype = SHAPES[fqn]
    st = sharded_tensor.empty(ST_SPECS[arg], *shape, dtype=dtype, init_rrefs=False)
    for s in st.local_shards():
        s.tensor.copy_(_region(full, s.metadata.shard_offsets, s.metadata.shard_sizes))
    return st


def check(value: Any, fqn: str, layout: str, mesh: Any) -> None:
    """``value`` is ``fqn`` in ``layout`` on this rank, byte for byte."""
    full = full_tensor(fqn)
    kind, _, arg = layout.partition(":")
    what = f"{fqn} as {layout}"
    if kind == "plain":
        assert type(value) is torch.Tensor, f"{what}: got {type(value).__name__}"
        helpers.assert_bitwise_equal(value, full, what)
    elif kind == "dt":
        assert isinstance(value, DTensor) and list(value.placements) == _placements(arg), what
        want = distribute_tensor(full, mesh, _placements(arg), src_data_rank=None).to_local()
        helpers.assert_bitwise_equal(value.to_local(), want, what)
    else:
        assert isinstance(value, ShardedTensor), f"{what}: got {type(value).__name__}"
        got = sorted(((tuple(s.metadata.shard_offsets), tuple(s.metadata.shard_sizes)), s.tensor)
                     for s in value.local_shards())
        assert [g for g, _ in got] == _my_st_shards(fqn, arg, dist.get_rank()), what
        for (off, size), t in got:
            helpers.assert_bitwise_equal(t, _region(full, off, size), f"{what}, shard at {list(off)}")


#: Non-tensor and replicated entries of every state dict (the same on every rank).
EXTRA = {"step": 4321, "tag": "parity"}
EXTRA_PLACEHOLDERS = {"step": -1, "tag": ""}


def _rep() -> torch.Tensor:
    return torch.arange(-6, 6, dtype=torch.int16).reshape(3, 4)


def state(combo: str, mesh: Any, sentinel: bool, rank: int, at_load: bool) -> dict[str, Any]:
    """A combo's state dict. Its key order differs between the ranks, and between save and load."""
    wl, vl = COMBOS[combo]
    items = {"w": build("w", wl, mesh, sentinel), "v": build("v", vl, mesh, sentinel),
             "rep": dr.complement(_rep()) if sentinel else _rep(),
             **(EXTRA_PLACEHOLDERS if sentinel else EXTRA)}
    order = sorted(items)
    if (rank == 1) != at_load:
        order.reverse()
    return {k: items[k] for k in order}


def check_state(sd: dict[str, Any], combo: str, mesh: Any) -> None:
    wl, vl = COMBOS[combo]
    check(sd["w"], "w", wl, mesh)
    check(sd["v"], "v", vl, mesh)
    helpers.assert_bitwise_equal(sd["rep"], _rep(), "rep")
    assert {k: sd[k] for k in EXTRA} == EXTRA


# ---------------------------------------------------------------------------- blobs, overwrite
class Counter(Stateful):
    """A Stateful with bytes, an int and a tensor."""

    def __init__(self, payload: bytes, count: int, weights: torch.Tensor) -> None:
        self.state = {"payload": payload, "count": count, "weights": weights}

    def state_dict(self) -> dict[str, Any]:
        return self.state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.state = state_dict


def _blobs(placeholders: bool) -> dict[str, Any]:
    weights = full_tensor("v")[:6].reshape(2, 3)
    if placeholders:
        return {"bytes0": [2], "bytes1": "other", "io": io.BytesIO(b""), "nested": {"a": [0, ""], "b": {"deep": None}},
                "counter": Counter(b"", 0, dr.complement(weights))}
    return {"bytes0": [1], "bytes1": "string", "io": io.BytesIO(b"\x00blob\xff" * 5),
            "nested": {"a": [3, "three"], "b": {"deep": (1.5, "x")}}, "counter": Counter(b"counted", 7, weights)}


def _check_blobs(sd: dict[str, Any]) -> None:
    want = _blobs(False)
    assert sd["bytes0"] == want["bytes0"] and sd["bytes1"] == want["bytes1"] and sd["nested"] == want["nested"]
    assert sd["io"].getvalue() == want["io"].getvalue()
    got, exp = sd["counter"].state_dict(), want["counter"].state_dict()
    assert (got["payload"], got["count"]) == (exp["payload"], exp["count"])
    helpers.assert_bitwise_equal(got["weights"], exp["weights"], "counter.weights")


def _version(v: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(v)
    sd: dict[str, Any] = {"a": torch.randn(4 + 2 * v, 3, generator=g), "version": v}
    sd["only_v1" if v == 1 else "only_v2"] = torch.randint(0, 99, (v + 2,), generator=g)
    return sd


def _check_version(path: str, reader: str, v: int) -> None:
    want = _version(v)
    loaded = {k: dr.complement(t) if isinstance(t, torch.Tensor) else 0 for k, t in want.items()}
    dcp.load(loaded, storage_reader=_reader(reader, path))
    helpers.assert_tree_equal(loaded, want)
    assert set(_reader(reader, path).read_metadata().state_dict_metadata) == set(want)


def _expect_refusal(path: str, writer: str) -> None:
    try:
        dcp.save(_version(2), storage_writer=WRITERS[writer](path, overwrite=False))
    except CheckpointException as e:
        errs = [f[0] if isinstance(f, tuple) else f for f in e.failures.values()]
    else:
        raise AssertionError("overwrite=False saved over an existing checkpoint")
    assert errs, "a CheckpointException without failures"
    for err in errs:
        assert isinstance(err, RuntimeError) and "Checkpoint already exists" in str(err), repr(err)
        if writer == "mmap":
            assert isinstance(err, mmapckpt.CheckpointExistsError), repr(err)


# ---------------------------------------------------------------------------- the checks, by name
def _ckpt(root: str, writer: str, combo: str) -> str:
    return os.path.join(root, f"{writer}.{combo}")


def check_names() -> list[str]:
    names = [f"save|{w}|{c}" for w in WRITERS for c in COMBOS]
    names += [f"load|{_pair_id(p)}|{a}->{b}" for p in PAIRS for a in COMBOS for b in COMBOS]
    names += [f"{what}|{_pair_id(p)}" for p in PAIRS for what in ("blobs", "overwrite")]
    names += [f"refuse|{first}-then-{second}" for first in WRITERS for second in WRITERS]
    return names


def _rank_main(rank: int, world: int, root: str, out: str) -> None:
    rec = dr.Recorder(out, "parity", rank)
    mesh = init_device_mesh("cpu", (world,))
    try:
        for w, writer_cls in WRITERS.items():
            for c in COMBOS:
                def save(w: str = w, c: str = c, cls: Any = writer_cls) -> None:
                    sd = state(c, mesh, False, rank, at_load=False)
                    dcp.save(sd, storage_writer=cls(_ckpt(root, w, c), **_save_options(c)))
                rec.run(f"save|{w}|{c}", save)
        for p in PAIRS:
            for a in COMBOS:
                for b in COMBOS:
                    def load(p: tuple[str, str] = p, a: str = a, b: str = b) -> None:
                        sd = state(b, mesh, True, rank, at_load=True)
                        dcp.load(sd, storage_reader=_reader(p[1], _ckpt(root, p[0], a)))
                        check_state(sd, b, mesh)
                    rec.run(f"load|{_pair_id(p)}|{a}->{b}", load)
        for p in PAIRS:
            def blobs(p: tuple[str, str] = p) -> None:
                path = os.path.join(root, f"blobs.{_pair_id(p)}")
                dcp.save(_blobs(False), storage_writer=WRITERS[p[0]](path, thread_count=2))
                sd = _blobs(True)
                dcp.load(sd, storage_reader=_reader(p[1], path))
                _check_blobs(sd)
            rec.run(f"blobs|{_pair_id(p)}", blobs)

            def overwrite(p: tuple[str, str] = p) -> None:
                path = os.path.join(root, f"overwrite.{_pair_id(p)}")
                dcp.save(_version(1), storage_writer=WRITERS[p[0]](path, overwrite=True))
                _check_version(path, p[1], 1)
                dcp.save(_version(2), storage_writer=WRITERS[p[0]](path, overwrite=True))
                _check_version(path, p[1], 2)
            rec.run(f"overwrite|{_pair_id(p)}", overwrite)
        for first, first_cls in WRITERS.items():
            for second in WRITERS:
                def refuse(first: str = first, second: str = second, cls: Any = first_cls) -> None:
                    path = os.path.join(root, f"refuse.{first}-then-{second}")
                    dcp.save(_version(1), storage_writer=cls(path))
                    _expect_refusal(path, second)
                    _check_version(path, "mmap", 1)
                    if first == "stock":
                        _check_version(path, "stock", 1)
                rec.run(f"refuse|{first}-then-{second}", refuse)
    finally:
        rec.dump()


# ---------------------------------------------------------------------------- the parent's side
@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("parity-ckpts"))


@pytest.fixture(scope="module")
def results(root: str, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, str]]:
    out = str(tmp_path_factory.mktemp("parity-results"))
    helpers.run_distributed(_rank_main, WORLD, root, out)
    return dr.read_results(out, "parity", WORLD)


def test_every_rank_ran_every_check(results: list[dict[str, str]]) -> None:
    for rank, res in enumerate(results):
        assert list(res) == check_names(), f"rank {rank} recorded other checks than planned"


@pytest.mark.parametrize("name", check_names())
def test_rank_check(name: str, results: list[dict[str, str]]) -> None:
    failed = {r: res.get(name, "not run") for r, res in enumerate(results) if res.get(name) != "ok"}
    assert not failed, "\n".join(f"rank {r}: {msg}" for r, msg in failed.items())


N_TO_1 = [(w, r, c) for w in WRITERS for r in ("stock", "mmap") if not (w == "mmap" and r == "stock")
          for c in ("st-row4.st-v7", "st-blocks.st-v12", "dt-S0.st-row4b", "st-col2.dt-S0")]


@pytest.mark.parametrize("writer, reader, combo", N_TO_1, ids=[f"{w}-writer-{r}-reader-{c}" for w, r, c in N_TO_1])
def test_two_rank_checkpoint_loads_in_one_process(writer: str, reader: str, combo: str, root: str,
                                                  results: Any) -> None:
    """Saved by 2 ranks as ShardedTensors/DTensors, loaded here (no process group) as plain tensors."""
    loaded: dict[str, Any] = {fqn: dr.complement(full_tensor(fqn)) for fqn in reversed(SHAPES)}
    loaded.update(rep=dr.complement(_rep()), **EXTRA_PLACEHOLDERS)
    helpers.dcp_load(loaded, _reader(reader, _ckpt(root, writer, combo)))
    for fqn in SHAPES:
        helpers.assert_bitwise_equal(loaded[fqn], full_tensor(fqn), fqn)
    helpers.assert_bitwise_equal(loaded["rep"], _rep(), "rep")
    assert {k: loaded[k] for k in EXTRA} == EXTRA


def _chunk_list(md: TensorStorageMetadata) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    return sorted((tuple(c.offsets), tuple(c.sizes)) for c in md.chunks)


@pytest.mark.parametrize("combo", list(COMBOS))
def test_metadata_matches_the_stock_writers(combo: str, root: str, results: Any) -> None:
    """The same 2-rank save through both writers describes the same entries, chunks and tensor properties."""
    ours = mmapckpt.MmapReader(_ckpt(root, "mmap", combo)).read_metadata().state_dict_metadata
    stock = FileSystemReader(_ckpt(root, "stock", combo)).read_metadata().state_dict_metadata
    assert set(ours) == set(stock) == {"w", "v", "rep", *EXTRA}
    for fqn, theirs in stock.items():
        mine = ours[fqn]
        assert type(mine) is type(theirs), fqn
        if not isinstance(theirs, TensorStorageMetadata):
            continue
        assert (mine.size, mine.properties) == (theirs.size, theirs.properties), fqn
        assert _chunk_list(mine) == _chunk_list(theirs), fqn
