"""Zero copy, checked from outside: tensors' memory lies in the shard file's mapping
(/proc/self/maps), and loading grows anonymous resident memory by almost nothing
(/proc/self/status RssAnon, in a fresh subprocess). Also ZeroCopyLoadPlanner and
SafeLoadPlanner under dcp.load."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

import helpers
import mmapckpt
from mmapckpt import MmapReader, SafeLoadPlanner, ZeroCopyLoadPlanner

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def mapping_ranges(path: str) -> list[tuple[int, int]]:
    """Address ranges where this process maps ``path`` (from /proc/self/maps)."""
    real = os.path.realpath(path)
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].strip() == real:
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                out.append((lo, hi))
    return out


def in_mapping(t: torch.Tensor, path: str) -> bool:
    lo_t = t.data_ptr()
    hi_t = lo_t + t.numel() * t.element_size()
    return any(lo <= lo_t and hi_t <= hi for lo, hi in mapping_ranges(path))


class Opaque:
    """A class a weights_only unpickler refuses (module-level so that it pickles)."""

    def __init__(self, v: int) -> None:
        self.v = v


@pytest.fixture
def ckpt(tmp_path):
    sd = {"w": torch.randn(64, 32), "b": torch.randn(32).to(torch.bfloat16), "ids": torch.arange(100),
          "nested": {"h": torch.randn(8, 8)}, "step": 5}
    path = str(tmp_path / "ck")
    helpers.dcp_save(sd, mmapckpt.MmapWriter(path, sync_files=False))
    return sd, path, os.path.join(path, "__0_0.distcp")


def test_get_tensor_and_load_return_views_into_the_mapping(ckpt):
    sd, path, shard = ckpt
    with mmapckpt.open(path) as f:
        w = f.get_tensor("w")
        sliced = f.get_slice("w")[3:9]
    assert in_mapping(w, shard)
    assert not in_mapping(sliced, shard)  # slices are fresh tensors
    loaded = mmapckpt.load(path)
    assert all(in_mapping(loaded[k], shard) for k in ("w", "b", "ids", "nested.h"))
    cast = mmapckpt.load(path, dtype=torch.float64, keys=["w", "ids"])
    assert not in_mapping(cast["w"], shard) and in_mapping(cast["ids"], shard)  # a cast copies; ints stay views


def test_mapping_check_is_not_vacuous(ckpt):
    _, path, shard = ckpt
    assert mapping_ranges(shard) == []  # nothing mapped before a load: the test sees real mappings only
    t = mmapckpt.load(path)["w"]
    assert mapping_ranges(shard) and in_mapping(t, shard) and not in_mapping(t.clone(), shard)


def test_zero_copy_planner_keeps_views_where_the_chunk_matches(ckpt):
    sd, path, shard = ckpt
    param = torch.nn.Parameter(torch.zeros(64, 32))
    targets = {"w": param, "b": torch.zeros(32, dtype=torch.float32),  # stored as bf16: must be copied
               "ids": torch.zeros(100, dtype=torch.int64), "nested": {"h": torch.zeros(8, 8)}, "step": 0}
    b_before, ids_before = targets["b"], targets["ids"]
    dcp.load(targets, storage_reader=MmapReader(path), planner=ZeroCopyLoadPlanner(), no_dist=True)
    assert isinstance(targets["w"], torch.nn.Parameter) and targets["w"].requires_grad
    assert in_mapping(targets["w"], shard) and in_mapping(targets["nested"]["h"], shard)
    assert in_mapping(targets["ids"], shard) and targets["ids"] is not ids_before
    assert targets["b"] is b_before and not in_mapping(targets["b"], shard)
    helpers.assert_bitwise_equal(targets["w"].detach(), sd["w"])
    helpers.assert_bitwise_equal(targets["b"], sd["b"].to(torch.float32))
    helpers.assert_bitwise_equal(targets["nested"]["h"], sd["nested"]["h"])
    assert targets["step"] == 5
    assert torch.all(param == 0)  # replaced, never written


def test_zero_copy_planner_falls_back_for_partial_targets_and_stock(ckpt, tmp_path):
    sd, path, shard = ckpt
    part = {"w": torch.zeros(64, 32)}
    dcp.load(part, storage_reader=MmapReader(path), planner=ZeroCopyLoadPlanner(allow_partial_load=True),
             no_dist=True)
    assert in_mapping(part["w"], shard)
    stock = str(tmp_path / "stock")
    helpers.dcp_save(sd, FileSystemWriter(stock, sync_files=False))
    t = {"w": torch.zeros(64, 32)}
    before = t["w"]
    dcp.load(t, storage_reader=MmapReader(stock), planner=ZeroCopyLoadPlanner(allow_partial_load=True), no_dist=True)
    assert t["w"] is before
    helpers.assert_bitwise_equal(before, sd["w"])


def test_safe_planner_refuses_arbitrary_pickles(tmp_path):
    path = str(tmp_path / "ck")
    helpers.dcp_save({"obj": Opaque(3), "n": 4}, mmapckpt.MmapWriter(path, sync_files=False))
    with pytest.raises(CheckpointException) as ei:
        dcp.load({"obj": None, "n": 0}, storage_reader=MmapReader(path), planner=SafeLoadPlanner(), no_dist=True)
    err = helpers.dcp_failure(ei.value)
    assert isinstance(err, mmapckpt.CheckpointError) and "allow_unpickle" in str(err)
    out = {"obj": None, "n": 0}
    dcp.load(out, storage_reader=MmapReader(path), planner=ZeroCopyLoadPlanner(allow_unpickle=True), no_dist=True)
    assert isinstance(out["obj"], Opaque) and out["obj"].v == 3 and out["n"] == 4
    ints = {"n": 0}
    dcp.load(ints, storage_reader=MmapReader(path), planner=SafeLoadPlanner(allow_partial_load=True), no_dist=True)
    assert ints["n"] == 4


_RSS_SCRIPT = textwrap.dedent("""
    import json, sys, torch, mmapckpt
    def anon():
        for line in open("/proc/self/status"):
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    path, mode = sys.argv[1], sys.argv[2]
    torch.zeros(1).sum()  # warm up the allocator and kernels outside the measurement
    mmapckpt.load, mmapckpt.open  # the package imports its names on first use: not inside the measurement
    base = anon()
    if mode == "load":
        sd = mmapckpt.load(path)
    else:
        f = mmapckpt.open(path)
        sd = {k: f.get_tensor(k) for k in f.keys()}
    loaded = anon()
    total = sum(float(t.view(torch.uint8)[:: 4096].sum()) for t in sd.values())  # touch every page
    touched = anon()
    first = next(iter(sd.values()))
    first.view(torch.uint8).fill_(1)  # copy-on-write: this one does grow RssAnon
    written = anon()
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    print(json.dumps({"load": loaded - base, "touch": touched - base, "written": written - touched,
                      "first": first.numel() * first.element_size(), "nbytes": nbytes}))
""")


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["load", "open"])
def test_loading_hundreds_of_mb_grows_rss_anon_by_almost_nothing(tmp_path_factory, mode):
    path = str(tmp_path_factory.getbasetemp() / "rss_ckpt")
    if not os.path.exists(os.path.join(path, ".metadata")):
        g = torch.Generator().manual_seed(0)
        sd = {f"layer{i}.weight": torch.randint(0, 256, (8 << 20,), dtype=torch.uint8, generator=g).view(torch.float32)
              for i in range(32)}  # 32 x 8 MiB = 256 MiB
        helpers.dcp_save(sd, mmapckpt.MmapWriter(path, sync_files=False))
        del sd
    res = subprocess.run([sys.executable, "-c", _RSS_SCRIPT, path, mode], capture_output=True, text=True,
                         timeout=300, check=True)
    m = json.loads(res.stdout.strip().splitlines()[-1])
    assert m["nbytes"] == 256 << 20
    assert m["load"] < 4 << 20, m
    assert m["touch"] < 4 << 20, m  # reading the pages maps the page cache; nothing is copied
    assert m["written"] > 0.9 * m["first"], m  # the probe does see copies
