"""Hypothesis-generated layouts through read-once loads on real gloo ranks.

Each example draws a few tensors (every dtype kind, 0-3 dimensions, sizes 0-7 so that
shards are uneven and some empty) with a save layout and a load layout (plain tensors,
or DTensors with random Shard/Replicate placements over 1-D and 2-D meshes), saves them
from one world size (tests/lazy_dist.py, as mmapckpt and as stock DCP) and loads them on
the other with ``read_once=True`` (``read_once_min_share=0``: always read-once; pieces of a
random, small size) and without. Every rank's local data must equal what the load layout
cuts out of the full tensors, byte for byte, for both loads.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import DTensor

import dist_ranks as dr
import helpers
import lazy_dist
from mmapckpt import MmapReader

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(600)]

DTYPES = ["float32", "bfloat16", "float8_e4m3fn", "int64", "bool", "complex64", "uint8", "float16"]
MESHES = {2: [(2,)], 4: [(4,), (2, 2)]}


def _layout(draw: st.DrawFn, shape: tuple[int, ...], world: int) -> tuple[tuple[int, ...], Any]:
    if not shape or draw(st.booleans()) and draw(st.booleans()):
        return (), None  # a plain tensor: every rank the whole of it
    mesh = draw(st.sampled_from(MESHES[world]))
    pl = tuple(draw(st.sampled_from([("R",)] + [("S", d) for d in range(len(shape))])) for _ in mesh)
    return mesh, pl


@st.composite
def cases(draw: st.DrawFn, save_world: int, load_world: int) -> tuple[lazy_dist.Spec, lazy_dist.Spec]:
    n = draw(st.integers(1, 4))
    save, load = [], []
    for i in range(n):
        dtype = draw(st.sampled_from(DTYPES))
        shape = tuple(draw(st.lists(st.integers(0, 7), min_size=0, max_size=3)))
        seed = draw(st.integers(0, 2**16))
        save.append((f"t{i}", dtype, shape, *_layout(draw, shape, save_world), seed))
        load.append((f"t{i}", dtype, shape, *_layout(draw, shape, load_world), seed))
    return save, load


def _local(v: Any) -> torch.Tensor:
    return v.to_local() if isinstance(v, DTensor) else v


def load_cases(rank: int, world: int, cases_: list[tuple[str, lazy_dist.Spec, int]], out: str) -> None:
    """Rank side: load each (checkpoint, load spec, piece size) read-once and plainly; record mismatches."""
    meshes: dict[tuple[int, ...], Any] = {}
    problems = []
    for path, spec, piece in cases_:
        want = lazy_dist.local_state_dict(spec, meshes)
        for read_once in (True, False):
            sd = lazy_dist.local_state_dict(spec, meshes)
            for name, *_ in spec:
                _local(sd[name]).copy_(dr.complement(_local(sd[name])))
            sd[lazy_dist.OBJECT_NAME] = [0, 0.0, 0.0]
            reader = MmapReader(path, read_once=read_once, read_once_min_share=0.0, read_once_piece_bytes=piece)
            try:
                dcp.load(sd, storage_reader=reader)
                for name, *_ in spec:
                    helpers.assert_bitwise_equal(_local(sd[name]), _local(want[name]), f"{path} {name}")
                assert sd[lazy_dist.OBJECT_NAME] == lazy_dist.OBJECT_VALUE
            except BaseException as e:  # noqa: BLE001 - reported by the parent
                problems.append(f"{path} read_once={read_once} piece={piece}: {type(e).__name__}: {e}"[:2000])
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(problems, f)


def _run(save_world: int, load_world: int, drawn: list[tuple[lazy_dist.Spec, lazy_dist.Spec]],
         pieces: list[int], tmp_path_factory: pytest.TempPathFactory) -> None:
    root = str(tmp_path_factory.mktemp(f"layouts-{save_world}-{load_world}"))
    out = os.path.join(root, "out")
    os.makedirs(out)
    try:
        helpers.run_distributed(lazy_dist.save_specs, save_world, [s for s, _ in drawn], root)
        todo = [(os.path.join(root, str(i), kind), load, pieces[i])
                for i, (_, load) in enumerate(drawn) for kind in ("mm", "stock")]
        helpers.run_distributed(load_cases, load_world, todo, out)
        problems = []
        for r in range(load_world):
            with open(os.path.join(out, f"rank{r}.json")) as f:
                problems += [f"rank {r}: {p}" for p in json.load(f)]
        assert not problems, "\n".join(problems)
    finally:
        shutil.rmtree(root, ignore_errors=True)


_SETTINGS = settings(max_examples=2, deadline=None, phases=[Phase.explicit, Phase.generate],
                     suppress_health_check=list(HealthCheck))


@_SETTINGS
@given(drawn=st.lists(cases(2, 4), min_size=2, max_size=3), pieces=st.lists(st.integers(1, 96), min_size=3,
                                                                          max_size=3))
def test_random_layouts_saved_on_2_loaded_read_once_on_4(drawn: Any, pieces: list[int],
                                                          tmp_path_factory: pytest.TempPathFactory) -> None:
    _run(2, 4, drawn, pieces, tmp_path_factory)


@_SETTINGS
@given(drawn=st.lists(cases(4, 2), min_size=2, max_size=3), pieces=st.lists(st.integers(1, 96), min_size=3,
                                                                          max_size=3))
def test_random_layouts_saved_on_4_loaded_read_once_on_2(drawn: Any, pieces: list[int],
                                                          tmp_path_factory: pytest.TempPathFactory) -> None:
    _run(4, 2, drawn, pieces, tmp_path_factory)
