"""Read-once loading (``MmapReader(read_once=True)``) over real gloo process groups.

Two spawns. On 2 ranks: save dist_ranks' mixed state dict (DTensor shards, replicated
DTensors, plain tensors, non-tensor values) with MmapWriter and with the stock writer,
and a tensor-parallel one (one big Shard(0) tensor, a small replicated one); load them
with read_once as fully replicated plain tensors (every rank the whole checkpoint), in
the sharding they were saved with and resharded (Shard(0) <-> Shard(1), Replicate <->
Shard), with pieces of a few bytes (every chunk split, rows split along inner
dimensions), verify=True and 2 threads; then from a copy with one flipped data byte
(verify=True: the rank assigned that record fails its checksum) and from a copy missing
a shard file: every rank must raise a CheckpointError naming the file, and none may hang
(the test's timeout). On 4 ranks: load the 2-rank checkpoints resharded onto 4, a 4-rank
checkpoint onto a (2, 2) mesh (records needed by a subset of ranks travel by send/recv),
and onto 3 of the 4 ranks (a subgroup passed as dcp.load's and the reader's group).

Every load is checked bit for bit against the expected data (dist_ranks.check_state_dict:
NaN payloads, -0.0, bf16, fp8, bool, complex) and each rank records its ``bytes_read``;
the sums over ranks are checked here against the checkpoint's stored bytes.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

import dist_ranks as dr
import helpers
from mmapckpt import CheckpointError, FastLoadPlanner, MmapReader, MmapWriter

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]


# ---------------------------------------------------------------------------- a tensor-parallel state dict
def _tp_full() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {"w": torch.randn(96, 64, generator=g), "norm": torch.randn(16, generator=g).to(torch.bfloat16)}


def _tp_state(mesh: Any, sentinel: bool) -> dict[str, Any]:
    full = {k: dr.complement(v) if sentinel else v for k, v in _tp_full().items()}
    return {"w": distribute_tensor(full["w"], mesh, [Shard(0)], src_data_rank=None), "norm": full["norm"]}


def _check_tp(sd: dict[str, Any], mesh: Any) -> None:
    full = _tp_full()
    want = distribute_tensor(full["w"], mesh, [Shard(0)], src_data_rank=None).to_local()
    helpers.assert_bitwise_equal(sd["w"].to_local(), want, "w")
    helpers.assert_bitwise_equal(sd["norm"], full["norm"], "norm")


# ---------------------------------------------------------------------------- rank side
class _Ranks:
    """One rank's checks: outcomes and bytes_read by name, written to ``out/<phase>.rank<r>.json``."""

    def __init__(self, out: str, phase: str, rank: int) -> None:
        self.rec = dr.Recorder(out, phase, rank)
        self.bytes: dict[str, int] = {}
        self.file = os.path.join(out, f"{phase}.rank{rank}.bytes.json")

    def load(self, name: str, path: str, mesh: Any, layout: dict[str, Any], group: Any = None,
             planner: Any = None, **kw: Any) -> None:
        def one() -> None:
            sd = dr.build_state_dict(mesh, layout, sentinel=True)
            reader = MmapReader(path, read_once_group=group, **kw)
            dcp.load(sd, storage_reader=reader, process_group=group, planner=planner)
            dr.check_state_dict(sd, mesh, layout)
            self.bytes[name] = reader.bytes_read
            if hasattr(planner, "seen"):  # commit_tensor saw every target filled
                assert planner.seen, "commit_tensor was never called"
        self.rec.run(name, one)

    def fails(self, name: str, path: str, mesh: Any, what: str, **kw: Any) -> None:
        """A load that must fail on this rank with a CheckpointError naming ``what``."""
        def one() -> None:
            sd = dr.build_state_dict(mesh, dr.PLAIN, sentinel=True)
            try:
                dcp.load(sd, storage_reader=MmapReader(path, read_once=True, **kw))
            except CheckpointException as e:
                err = helpers.dcp_failure(e, dist.get_rank())
                assert isinstance(err, CheckpointError), f"{type(err).__name__}: {err}"
                assert what in str(err), f"{err} does not name {what}"
                return
            raise AssertionError("the load succeeded")
        self.rec.run(name, one)

    def dump(self) -> None:
        self.rec.dump()
        with open(self.file, "w") as f:
            json.dump(self.bytes, f)


def _largest_record(path: str) -> tuple[str, int]:
    md = MmapReader(path).read_metadata()
    info = max(md.storage_data.values(), key=lambda i: i.length)
    return info.relative_path, info.offset


def _damaged_copies(root: str) -> None:
    """m2 with one data byte flipped (m2_flip), and without its second shard file (m2_miss)."""
    src = os.path.join(root, "m2")
    shutil.copytree(src, os.path.join(root, "m2_flip"))
    rel, offset = _largest_record(src)
    with open(os.path.join(root, "m2_flip", rel), "r+b") as f:
        f.seek(offset + 3)
        b = f.read(1)
        f.seek(offset + 3)
        f.write(bytes([b[0] ^ 0x10]))
    shutil.copytree(src, os.path.join(root, "m2_miss"))
    os.unlink(os.path.join(root, "m2_miss", "__1_0.distcp"))


def phase_two(rank: int, world: int, root: str, out: str) -> None:
    r = _Ranks(out, "two", rank)
    try:
        mesh = init_device_mesh("cpu", (world,))
        sd = dr.build_state_dict(mesh, dr.SAVE, sentinel=False)
        dcp.save(sd, storage_writer=MmapWriter(os.path.join(root, "m2")))
        dcp.save(sd, storage_writer=FileSystemWriter(os.path.join(root, "s2")))
        dcp.save(_tp_state(mesh, False), storage_writer=MmapWriter(os.path.join(root, "tp2")))
        dist.barrier()
        if rank == 0:
            _damaged_copies(root)
        dist.barrier()
        m2, s2 = os.path.join(root, "m2"), os.path.join(root, "s2")
        r.load("plain:m2", m2, mesh, dr.PLAIN)
        r.load("replicated:m2", m2, mesh, dr.PLAIN, read_once=True)
        r.load("replicated:m2:pieces-48:verify:threads-2", m2, mesh, dr.PLAIN, read_once=True,
               read_once_piece_bytes=48, verify=True, thread_count=2)
        r.load("replicated:m2:pieces-1:mapped", m2, mesh, dr.PLAIN, read_once=True, read_once_piece_bytes=1,
               direct_reads=False)
        r.load("replicated:s2", s2, mesh, dr.PLAIN, read_once=True)
        r.load("plain:s2", s2, mesh, dr.PLAIN)
        r.load("same-sharding:m2", m2, mesh, dr.SAVE, read_once=True)
        r.load("same-sharding:m2:forced", m2, mesh, dr.SAVE, read_once=True, read_once_min_share=0.0)
        r.load("resharded:m2:forced:pieces-40", m2, mesh, dr.ALT, read_once=True, read_once_min_share=0.0,
               read_once_piece_bytes=40)
        r.load("resharded:s2:forced", s2, mesh, dr.ALT, read_once=True, read_once_min_share=0.0)
        r.load("replicated:m2:fast-planner", m2, mesh, dr.PLAIN, planner=FastLoadPlanner(), read_once=True)
        r.load("resharded:m2:planner-of-its-own", m2, mesh, dr.ALT, planner=helpers.checksum_at_commit_planner(),
               read_once=True, read_once_min_share=0.0, read_once_piece_bytes=40)

        def tp(read_once: bool) -> None:
            sd = _tp_state(mesh, True)
            reader = MmapReader(os.path.join(root, "tp2"), read_once=read_once)
            dcp.load(sd, storage_reader=reader)
            _check_tp(sd, mesh)
            r.bytes[f"tp:{read_once}"] = reader.bytes_read
        r.rec.run("tensor-parallel:plain", lambda: tp(False))
        r.rec.run("tensor-parallel:read-once", lambda: tp(True))
        rel, _ = _largest_record(m2)
        r.fails("fails:flipped-byte:verify", os.path.join(root, "m2_flip"), mesh, os.path.join("m2_flip", rel),
                verify=True)
        r.fails("fails:missing-shard", os.path.join(root, "m2_miss"), mesh, "__1_0.distcp")
        r.load("after-failures:replicated:m2", m2, mesh, dr.PLAIN, read_once=True)
    finally:
        r.dump()


def phase_four(rank: int, world: int, root: str, out: str) -> None:
    r = _Ranks(out, "four", rank)
    try:
        mesh = init_device_mesh("cpu", (world,))
        mesh2d = init_device_mesh("cpu", (2, 2))
        sd = dr.build_state_dict(mesh, dr.SAVE, sentinel=False)
        dcp.save(sd, storage_writer=MmapWriter(os.path.join(root, "m4")))
        dist.barrier()
        m2, m4, s2 = (os.path.join(root, n) for n in ("m2", "m4", "s2"))
        r.load("2->4:replicated:m2", m2, mesh, dr.PLAIN, read_once=True)
        r.load("2->4:same-placements:m2", m2, mesh, dr.SAVE, read_once=True, read_once_min_share=0.0)
        r.load("2->4:resharded:m2:pieces-40", m2, mesh, dr.ALT, read_once=True, read_once_min_share=0.0,
               read_once_piece_bytes=40)
        r.load("2->4:resharded:s2", s2, mesh, dr.ALT, read_once=True, read_once_min_share=0.0)
        r.load("4->4:replicated:m4", m4, mesh, dr.PLAIN, read_once=True)
        r.load("4->4:plain:m4", m4, mesh, dr.PLAIN)
        r.load("4->2x2:m4:pieces-64", m4, mesh2d, dr.MESH2D, read_once=True, read_once_min_share=0.0,
               read_once_piece_bytes=64)
        r.load("4->2x2:m4:default", m4, mesh2d, dr.MESH2D, read_once=True)
        # 3 of the 4 ranks load, over a subgroup: dcp.load's process group is the reader's.
        mesh3 = DeviceMesh("cpu", [0, 1, 2])
        if rank < 3:
            group = mesh3.get_group()
            r.load("2->3:replicated:m2", m2, mesh3, dr.PLAIN, group=group, read_once=True)
            r.load("2->3:resharded:m2:pieces-40", m2, mesh3, dr.ALT, group=group, read_once=True,
                   read_once_min_share=0.0, read_once_piece_bytes=40)
            r.load("4->3:resharded:m4", m4, mesh3, dr.ALT, group=group, read_once=True, read_once_min_share=0.0)
        dist.barrier()
    finally:
        r.dump()


# ---------------------------------------------------------------------------- parent side
CHECKS = {
    "two": ["plain:m2", "replicated:m2", "replicated:m2:pieces-48:verify:threads-2", "replicated:m2:pieces-1:mapped",
            "replicated:s2", "plain:s2", "same-sharding:m2", "same-sharding:m2:forced",
            "resharded:m2:forced:pieces-40", "resharded:s2:forced", "replicated:m2:fast-planner",
            "resharded:m2:planner-of-its-own", "tensor-parallel:plain",
            "tensor-parallel:read-once", "fails:flipped-byte:verify", "fails:missing-shard",
            "after-failures:replicated:m2"],
    "four": ["2->4:replicated:m2", "2->4:same-placements:m2", "2->4:resharded:m2:pieces-40", "2->4:resharded:s2",
             "4->4:replicated:m4", "4->4:plain:m4", "4->2x2:m4:pieces-64", "4->2x2:m4:default",
             "2->3:replicated:m2", "2->3:resharded:m2:pieces-40", "4->3:resharded:m4"],
}
WORLD = {"two": 2, "four": 4}


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("read-once"))


def _spawn(phase: str, fn: Any, root: str, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = str(tmp_path_factory.mktemp(f"results-{phase}"))
    helpers.run_distributed(fn, WORLD[phase], root, out)
    res = dr.read_results(out, phase, WORLD[phase])
    for rk, d in enumerate(res):
        with open(os.path.join(out, f"{phase}.rank{rk}.bytes.json")) as f:
            d["bytes"] = json.load(f)
    return res


@pytest.fixture(scope="module")
def two(root: str, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return _spawn("two", phase_two, root, tmp_path_factory)


@pytest.fixture(scope="module")
def four(root: str, two: Any, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return _spawn("four", phase_four, root, tmp_path_factory)


@pytest.mark.parametrize("phase,check", [(p, c) for p in CHECKS for c in CHECKS[p]])
def test_rank_check(phase: str, check: str, request: pytest.FixtureRequest) -> None:
    results = request.getfixturevalue(phase)
    ranks = range(3) if check.startswith(("2->3", "4->3")) else range(WORLD[phase])
    failed = {rk: results[rk].get(check, "not run") for rk in ranks if results[rk].get(check) != "ok"}
    assert not failed, "\n".join(f"rank {rk}: {msg}" for rk, msg in failed.items())


def _stored_bytes(path: str) -> int:
    return sum(i.length for i in MmapReader(path).read_metadata().storage_data.values())


def _sum(results: list[dict[str, Any]], name: str) -> int:
    return sum(res["bytes"][name] for res in results if name in res["bytes"])


@pytest.mark.parametrize("phase,name,ckpt,world", [("two", "replicated:m2", "m2", 2), ("two", "replicated:s2", "s2", 2),
                                                   ("two", "replicated:m2:pieces-48:verify:threads-2", "m2", 2),
                                                   ("two", "replicated:m2:pieces-1:mapped", "m2", 2),
                                                   ("four", "2->4:replicated:m2", "m2", 4),
                                                   ("four", "4->4:replicated:m4", "m4", 4),
                                                   ("four", "2->3:replicated:m2", "m2", 3)])
def test_replicated_load_reads_each_stored_byte_once(phase: str, name: str, ckpt: str, world: int, root: str,
                                                      request: pytest.FixtureRequest) -> None:
    results = request.getfixturevalue(phase)
    stored = _stored_bytes(os.path.join(root, ckpt))
    assert _sum(results, name) == stored
    counts = [res["bytes"][name] for res in results[:world]]
    assert all(c > 0 for c in counts), f"every rank reads a share: {counts}"


@pytest.mark.parametrize("phase,name,ckpt,world", [("two", "plain:m2", "m2", 2), ("two", "plain:s2", "s2", 2),
                                                   ("four", "4->4:plain:m4", "m4", 4)])
def test_plain_replicated_load_reads_every_byte_on_every_rank(phase: str, name: str, ckpt: str, world: int,
                                                              root: str, request: pytest.FixtureRequest) -> None:
    results = request.getfixturevalue(phase)
    stored = _stored_bytes(os.path.join(root, ckpt))
    assert [res["bytes"][name] for res in results] == [stored] * world


def test_tensor_parallel_load_falls_back_to_the_plain_plans(two: list[dict[str, Any]]) -> None:
    """Few shared bytes (a replicated norm next to a sharded weight): every rank reads its own plan."""
    assert [res["bytes"]["tp:True"] for res in two] == [res["bytes"]["tp:False"] for res in two]


def test_resharded_read_once_reads_less_than_the_plain_path(two: list[dict[str, Any]], root: str) -> None:
    assert _sum(two, "resharded:m2:forced:pieces-40") <= _stored_bytes(os.path.join(root, "m2"))

