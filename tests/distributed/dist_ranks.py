"""The state dict, its shardings and the rank functions of the multi-rank tests.

The rank functions (``phase_*``) run inside spawned gloo ranks (tests/helpers.py
``run_distributed``); this module is imported there by name, from the sys.path the
spawned child inherits. Each check records its outcome in a per-rank JSON file
instead of raising, so the parent reports every check as its own test; a crash or
hang of a rank still fails the whole spawn.

Test data: every tensor is the same on every rank and in the parent, built from
seeded random bytes viewed as its dtype (NaN payloads, infinities, -0.0 and
subnormals included; some are planted on purpose), so any process can recompute
the expected full tensor and the expected local shard of any sharding. Load
targets start as the bitwise complement of the expected values, so every byte a
load fails to write shows up as a mismatch.
"""

from __future__ import annotations

import json
import os
import traceback
import zlib
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor, init_device_mesh

import helpers
from mmapckpt import MmapReader, MmapWriter

# ---------------------------------------------------------------------------- the data
#: flat fqn -> (shape, dtype). Dims are mostly not divisible by 2 or 4 (uneven shards);
#: "tiny" has fewer rows than ranks, so some ranks hold empty shards of it.
TENSORS: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
    "emb_weight": ((37, 12), torch.bfloat16),
    "proj_weight": ((8, 30), torch.float32),
    "rep_scale": ((5, 7), torch.float8_e4m3fn),
    "ids": ((9,), torch.int64),
    "mask": ((3, 11), torch.bool),
    "opt.state.m": ((13, 6), torch.float8_e5m2),
    "opt.state.v": ((6, 10), torch.float16),
    "tiny": ((2, 3), torch.int32),
    "bias": ((10,), torch.float64),
    "buffers.0": ((4, 4), torch.int8),
    "buffers.1": ((3,), torch.complex64),
}

#: Non-tensor values (stored as BYTE_IO entries): expected values and load placeholders.
NON_TENSORS: dict[str, Any] = {"step": 1234, "meta": {"name": "run-7", "lr": 3e-4, "betas": (0.9, 0.95)}}
NON_TENSOR_PLACEHOLDERS: dict[str, Any] = {"step": -1, "meta": {"name": "", "lr": 0.0, "betas": (0.0, 0.0)}}

# Placements by fqn: "S0"/"S1" = Shard(dim), "R" = Replicate, "-" = a plain (non-DTensor) tensor.
# Tuples are placements over a 2-D mesh.
SAVE: dict[str, Any] = {
    "emb_weight": "S0", "proj_weight": "S1", "rep_scale": "R", "ids": "S0", "mask": "S1",
    "opt.state.m": "S0", "opt.state.v": "S1", "tiny": "S0", "bias": "-", "buffers.0": "-", "buffers.1": "R",
}
#: Another sharding of every entry: Shard(0) <-> Shard(1), Replicate -> Shard, Shard -> Replicate,
#: plain -> DTensor and DTensor -> plain.
ALT: dict[str, Any] = {
    "emb_weight": "S1", "proj_weight": "S0", "rep_scale": "S0", "ids": "R", "mask": "-",
    "opt.state.m": "S1", "opt.state.v": "R", "tiny": "S1", "bias": "S0", "buffers.0": "S1", "buffers.1": "S0",
}
#: Over a (2, 2) mesh.
MESH2D: dict[str, Any] = {
    "emb_weight": ("S0", "S1"), "proj_weight": ("S1", "R"), "rep_scale": ("R", "S0"), "ids": ("R", "S0"),
    "mask": ("S1", "S0"), "opt.state.m": ("S0", "S0"), "opt.state.v": ("R", "R"), "tiny": ("S1", "S0"),
    "bias": ("S0", "R"), "buffers.0": "-", "buffers.1": ("S0", "S0"),
}
#: Every entry a plain, full tensor (a single-process load).
PLAIN: dict[str, Any] = {fqn: "-" for fqn in TENSORS}

_FLOAT_SPECIALS = ("negzero", "all_ones_nan", "max_payload_nan")


def _special_bytes(kind: str, size: int) -> bytes:
    """Little-endian bytes of a special value valid for every float format of ``size`` bytes."""
    if kind == "negzero":
        return bytes(size - 1) + b"\x80"  # sign bit only: -0.0
    if kind == "all_ones_nan":
        return b"\xff" * size  # negative NaN, every payload bit set
    return b"\xff" * (size - 1) + b"\x7f"  # positive NaN, every payload bit set


def full_tensor(fqn: str) -> torch.Tensor:
    """The expected full value of ``fqn``: seeded random bytes viewed as its dtype."""
    shape, dtype = TENSORS[fqn]
    numel = 1
    for s in shape:
        numel *= s
    size = torch.empty((), dtype=dtype).element_size()
    g = torch.Generator().manual_seed(zlib.crc32(fqn.encode()))
    raw = torch.randint(0, 256, (numel * size,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw &= 1  # only 0 and 1 are valid bools
    elif dtype.is_floating_point and numel:
        step = max(1, numel // 6)
        for j, i in enumerate(range(0, numel, step)):
            pat = _special_bytes(_FLOAT_SPECIALS[j % len(_FLOAT_SPECIALS)], size)
            raw[i * size:(i + 1) * size] = torch.frombuffer(bytearray(pat), dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)


def complement(t: torch.Tensor) -> torch.Tensor:
    """A tensor of the same dtype and shape whose every byte differs from ``t``'s."""
    t = t.contiguous()
    if t.dtype == torch.bool:
        return ~t
    flat = t.reshape(-1).view(torch.uint8)
    return (flat ^ 0xFF).view(t.dtype).reshape(t.shape)


def placements_of(spec: Any) -> list[Any]:
    names = spec if isinstance(spec, tuple) else (spec,)
    return [Replicate() if n == "R" else Shard(int(n[1:])) for n in names]


def expected_local(fqn: str, mesh: Any, spec: Any) -> torch.Tensor:
    """What rank holds of ``fqn`` under ``spec`` (the full tensor for a plain entry)."""
    full = full_tensor(fqn)
    if spec == "-":
        return full
    # src_data_rank=None: every rank slices its own shard locally, no communication.
    return distribute_tensor(full, mesh, placements_of(spec), src_data_rank=None).to_local()


def _value(fqn: str, mesh: Any, spec: Any, sentinel: bool) -> torch.Tensor:
    full = full_tensor(fqn)
    if sentinel:
        full = complement(full)
    if spec == "-":
        return full
    return distribute_tensor(full, mesh, placements_of(spec), src_data_rank=None)


def _set_path(sd: dict[str, Any], fqn: str, value: Any) -> None:
    keys = fqn.split(".")
    node: Any = sd
    for k in keys[:-1]:
        node = node.setdefault(k, {})
    node[keys[-1]] = value


def _get_path(sd: dict[str, Any], fqn: str) -> Any:
    node: Any = sd
    for k in fqn.split("."):
        node = node[int(k)] if isinstance(node, list) else node[k]
    return node


def build_state_dict(mesh: Any, layout: dict[str, Any], *, sentinel: bool) -> dict[str, Any]:
    """The test state dict under ``layout``: expected values, or load targets (``sentinel``)."""
    sd: dict[str, Any] = {}
    for fqn in TENSORS:
        if not fqn.startswith("buffers."):
            _set_path(sd, fqn, _value(fqn, mesh, layout[fqn], sentinel))
    sd["buffers"] = [_value(f"buffers.{i}", mesh, layout[f"buffers.{i}"], sentinel) for i in range(2)]
    extra = NON_TENSOR_PLACEHOLDERS if sentinel else NON_TENSORS
    sd.update(json.loads(json.dumps(extra)))  # a fresh copy (tuples become lists: restore them)
    sd["meta"]["betas"] = tuple(sd["meta"]["betas"])
    return sd


def local_bytes(sd: dict[str, Any]) -> dict[str, bytes]:
    """Every tensor's local bytes (DTensor: the local shard), for comparisons between loads."""
    out = {}
    for fqn in TENSORS:
        v = _get_path(sd, fqn)
        out[fqn] = helpers.tensor_bytes(v.to_local() if isinstance(v, DTensor) else v)
    return out


def check_state_dict(sd: dict[str, Any], mesh: Any, layout: dict[str, Any]) -> None:
    """Raise AssertionError unless ``sd`` holds exactly the expected data, bit for bit."""
    for fqn in TENSORS:
        got, spec = _get_path(sd, fqn), layout[fqn]
        if spec == "-":
            assert not isinstance(got, DTensor), f"{fqn}: a plain tensor became a DTensor"
            helpers.assert_bitwise_equal(got, full_tensor(fqn), fqn)
            continue
        assert isinstance(got, DTensor), f"{fqn}: expected a DTensor, got {type(got).__name__}"
        assert list(got.placements) == placements_of(spec), f"{fqn}: placements {got.placements}"
        assert tuple(got.shape) == TENSORS[fqn][0], f"{fqn}: global shape {tuple(got.shape)}"
        helpers.assert_bitwise_equal(got.to_local(), expected_local(fqn, mesh, spec), f"{fqn} (local shard)")
    for key, want in NON_TENSORS.items():
        helpers.assert_tree_equal(want, sd[key], key)


# ---------------------------------------------------------------------------- check recording
class Recorder:
    """Runs named checks on one rank and writes their outcomes to ``out/<phase>.rank<r>.json``."""

    def __init__(self, out: str, phase: str, rank: int) -> None:
        self.file = os.path.join(out, f"{phase}.rank{rank}.json")
        self.results: dict[str, str] = {}

    def run(self, name: str, fn: Callable[[], Any]) -> Any:
        try:
            value = fn()
        except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
            detail = ""
            if isinstance(e, CheckpointException):
                detail = "".join(f"\n  rank {r}: {type(x).__name__}: {x}" for r, x in e.failures.items())
            self.results[name] = f"{type(e).__name__}: {e}{detail}\n{traceback.format_exc()}"
            return None
        self.results[name] = "ok"
        return value

    def dump(self) -> None:
        with open(self.file, "w") as f:
            json.dump(self.results, f, indent=1)


def read_results(out: str, phase: str, world: int) -> list[dict[str, str]]:
    """The per-rank outcome dicts a phase left in ``out`` (raises if a rank left none)."""
    res = []
    for r in range(world):
        with open(os.path.join(out, f"{phase}.rank{r}.json")) as f:
            res.append(json.load(f))
    return res


# ---------------------------------------------------------------------------- loads
#: reader name -> factory. "mmap-mapped" copies every region out of the mapping (no preadv into
#: the target), reads files on 2 threads and verifies each entry's CRC-32. "mmap-staged" sends
#: every region through the accelerator staging pipeline (CPU buffers of 256 bytes: packing,
#: pieces and buffer reuse), as dcp.load into GPU targets does.


def _staged(reader: Any) -> Any:
    reader._stage_cpu_targets = True
    return reader


READERS: dict[str, Callable[[str], Any]] = {
    "mmap": MmapReader,
    "mmap-mapped": lambda path: MmapReader(path, thread_count=2, verify=True, direct_reads=False),
    "mmap-staged": lambda path: _staged(MmapReader(path, staging_bytes=256, staging_buffers=2)),
    "stock": FileSystemReader,
}


def load_into(path: str, reader: str, mesh: Any, layout: dict[str, Any], *, no_dist: bool = False) -> dict[str, Any]:
    """``dcp.load`` the checkpoint at ``path`` into fresh sentinel targets laid out as ``layout``."""
    sd = build_state_dict(mesh, layout, sentinel=True)
    dcp.load(sd, storage_reader=READERS[reader](path), no_dist=no_dist)
    return sd


def _load_checks(rec: Recorder, root: str, mesh: Any, layout: dict[str, Any], lname: str,
                 loads: list[tuple[str, str]], tag: str) -> None:
    """Load each (checkpoint, reader) into ``layout``, check it, then check that all loads agree."""
    seen: dict[str, dict[str, bytes]] = {}
    for ckpt, reader in loads:
        def one(ckpt: str = ckpt, reader: str = reader) -> dict[str, bytes]:
            sd = load_into(os.path.join(root, ckpt), reader, mesh, layout)
            check_state_dict(sd, mesh, layout)
            return local_bytes(sd)
        got = rec.run(f"{tag}:{ckpt}:{reader}-reader:{lname}", one)
        if got is not None:
            seen[f"{ckpt}/{reader}"] = got

    def agree() -> None:
        assert len(seen) == len(loads), f"only {sorted(seen)} of {len(loads)} loads succeeded"
        first, *rest = seen.items()
        for name, b in rest:
            for fqn in TENSORS:
                assert b[fqn] == first[1][fqn], f"{fqn}: {name} differs from {first[0]}"
    rec.run(f"{tag}:all-loads-agree:{lname}", agree)


def _save_checks(rec: Recorder, root: str, mesh: Any, layout: dict[str, Any], tag: str, mmap_name: str,
                 stock_name: str | None, thread_count: int) -> None:
    sd = build_state_dict(mesh, layout, sentinel=False)
    rec.run(f"{tag}:save-mmap", lambda: dcp.save(
        sd, storage_writer=MmapWriter(os.path.join(root, mmap_name), thread_count=thread_count)))
    if stock_name is not None:
        rec.run(f"{tag}:save-stock", lambda: dcp.save(
            sd, storage_writer=FileSystemWriter(os.path.join(root, stock_name), thread_count=thread_count)))
    rec.run(f"{tag}:source-unchanged-by-save", lambda: check_state_dict(sd, mesh, layout))


def _scramble(sd: dict[str, Any]) -> None:
    """Overwrite every local tensor of ``sd`` in place with its complement."""
    for fqn in TENSORS:
        v = _get_path(sd, fqn)
        local = v.to_local() if isinstance(v, DTensor) else v
        local.copy_(complement(local))


# ---------------------------------------------------------------------------- phases (rank functions)
# Checkpoints under root: m2/s2 (2 ranks, MmapWriter/stock writer, thread_count=2), a2 (2 ranks,
# dcp.async_save with MmapWriter), m4/s4 (4 ranks, thread_count=1), m4_2d (4 ranks over a (2, 2) mesh).
# A save is (tag, mesh, layout, mmap dir, stock dir or None, thread_count); a load group is
# (tag, mesh, layout, layout name, [(checkpoint dir, reader)]).
LAYOUTS: dict[str, dict[str, Any]] = {"save": SAVE, "alt": ALT, "mesh2d": MESH2D}
_LOADS_2 = [("m2", "mmap"), ("m2", "mmap-mapped"), ("m2", "mmap-staged"), ("a2", "mmap"), ("s2", "mmap"),
            ("s2", "stock")]
_LOADS_4 = [("m4", "mmap"), ("m4", "mmap-mapped"), ("m4", "mmap-staged"), ("s4", "mmap"), ("s4", "stock")]
PHASES: dict[str, dict[str, Any]] = {
    "two_save": {"world": 2, "async": "a2",
                 "saves": [("2r", "1d", "save", "m2", "s2", 2)],
                 "loads": [("2r->2r", "1d", "save", "same-sharding", _LOADS_2),
                           ("2r->2r", "1d", "alt", "resharded", _LOADS_2)]},
    "four": {"world": 4, "async": None,
             "saves": [("4r", "1d", "save", "m4", "s4", 1), ("4r-2d", "2d", "mesh2d", "m4_2d", None, 1)],
             "loads": [("2r->4r", "1d", "save", "same-placements", _LOADS_2),
                       ("2r->4r", "1d", "alt", "resharded", _LOADS_2),
                       ("4r->4r", "1d", "save", "same-sharding", _LOADS_4),
                       ("4r->4r", "1d", "alt", "resharded", _LOADS_4),
                       ("4r->4r", "2d", "mesh2d", "2d-mesh", _LOADS_4)]},
    "two_load": {"world": 2, "async": None, "saves": [],
                 "loads": [("4r->2r", "1d", "save", "same-placements", _LOADS_4),
                           ("4r->2r", "1d", "alt", "resharded", _LOADS_4),
                           ("4r-2d->2r", "1d", "alt", "resharded", [("m4_2d", "mmap")])]},
}


def check_names(phase: str) -> list[str]:
    """The names of the checks ``run_phase`` records for ``phase``, in order."""
    p, names = PHASES[phase], []
    for tag, _, _, _, stock, _ in p["saves"]:
        names += [f"{tag}:save-mmap"] + ([f"{tag}:save-stock"] if stock else []) + [f"{tag}:source-unchanged-by-save"]
    if p["async"]:
        names.append(f"{p['world']}r:async-save-mmap")
    for tag, _, _, lname, loads in p["loads"]:
        names += [f"{tag}:{ckpt}:{reader}-reader:{lname}" for ckpt, reader in loads]
        names.append(f"{tag}:all-loads-agree:{lname}")
    return names


def _async_save(root: str, name: str, mesh: Any) -> None:
    sd = build_state_dict(mesh, SAVE, sentinel=False)
    fut = dcp.async_save(sd, storage_writer=MmapWriter(os.path.join(root, name)))
    _scramble(sd)  # staged before async_save returned: later changes must not reach the checkpoint
    fut.result()


def run_phase(rank: int, world: int, phase: str, root: str, out: str) -> None:
    """The rank function: run ``phase``'s saves, then (after a barrier) its loads."""
    p = PHASES[phase]
    assert world == p["world"], f"{phase} runs on {p['world']} ranks, not {world}"
    rec = Recorder(out, phase, rank)
    try:
        meshes = {"1d": init_device_mesh("cpu", (world,))}
        if world == 4:
            meshes["2d"] = init_device_mesh("cpu", (2, 2))
        for tag, mesh, layout, mm, stock, threads in p["saves"]:
            _save_checks(rec, root, meshes[mesh], LAYOUTS[layout], tag, mm, stock, threads)
        if p["async"]:
            rec.run(f"{world}r:async-save-mmap", lambda: _async_save(root, p["async"], meshes["1d"]))
        dist.barrier()
        for tag, mesh, layout, lname, loads in p["loads"]:
            _load_checks(rec, root, meshes[mesh], LAYOUTS[layout], lname, loads, tag)
    finally:
        rec.dump()
