"""``MmapReader.bytes_read``: the bytes one load took from checkpoint files, each stored byte once.

Single-process loads of an mmapckpt checkpoint (direct reads, the mapped path, verify=True,
a narrowed region) and of a stock one. Where the read path uses read calls (preadv
straight into the targets, stock items), the count is cross-checked against this
process's ``rchar`` in ``/proc/self/io``: the load read at least ``bytes_read`` bytes, and
no more than that plus the metadata file and the shard headers.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from helpers import assert_bitwise_equal, dcp_load, dcp_save
from mmapckpt import MmapReader, MmapWriter
from mmapckpt.dcp.bytes_read import BytesRead

HAS_PROC_IO = os.path.exists("/proc/self/io")


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    return {"a": torch.randn(512, 1024, generator=g),  # 2 MiB
            "b": torch.randn(300, 700, generator=g).to(torch.bfloat16),
            "c": torch.randint(0, 2**31 - 1, (4096,), generator=g, dtype=torch.int64)}


def _targets(sd: dict[str, Any]) -> dict[str, Any]:
    return {k: torch.zeros_like(v) for k, v in sd.items()}


def _stored(path: str) -> int:
    return sum(i.length for i in MmapReader(path).read_metadata().storage_data.values())


def _rchar() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("bytes-read")
    sd = _state()
    out = {"mmap": str(root / "mmap"), "stock": str(root / "stock")}
    dcp_save(sd, MmapWriter(out["mmap"]))
    dcp_save(sd, FileSystemWriter(out["stock"]))
    return out


def _load(path: str, **kw: Any) -> tuple[MmapReader, int]:
    """Load the whole checkpoint, check it, return the reader and the rchar this process spent on it."""
    reader = MmapReader(path, **kw)
    targets = _targets(_state())
    before = _rchar() if HAS_PROC_IO else 0
    dcp_load(targets, reader)
    spent = (_rchar() - before) if HAS_PROC_IO else 0
    for k, v in _state().items():
        assert_bitwise_equal(targets[k], v, k)
    return reader, spent


def _overhead(path: str) -> int:
    """What a load reads besides the records: the metadata file and each shard's preamble and header."""
    return sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path) if n == ".metadata") + (256 << 10)


@pytest.mark.parametrize("kind,kw", [("mmap", {}), ("mmap", {"direct_reads": False}), ("mmap", {"verify": True}),
                                     ("mmap", {"thread_count": 2, "verify": True, "direct_reads": False}),
                                     ("stock", {})])
def test_a_whole_load_counts_every_stored_byte_once(ckpts: dict[str, str], kind: str, kw: dict[str, Any]) -> None:
    reader, _ = _load(ckpts[kind], **kw)
    assert reader.bytes_read == _stored(ckpts[kind])


@pytest.mark.skipif(not HAS_PROC_IO, reason="needs /proc/self/io")
@pytest.mark.parametrize("kind", ["mmap", "stock"])
def test_bytes_read_agrees_with_rchar_where_reads_are_read_calls(ckpts: dict[str, str], kind: str,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Direct reads (preadv into the targets) and stock items (pread) go through read calls."""
    from mmapckpt.io import direct_reads

    monkeypatch.setattr(direct_reads, "SMALL_CACHED_COPY", 0)  # small cached regions too are read, not copied
    reader, spent = _load(ckpts[kind], direct_reads=True)
    assert reader.bytes_read == _stored(ckpts[kind])
    assert reader.bytes_read <= spent <= reader.bytes_read + _overhead(ckpts[kind]), (reader.bytes_read, spent)


@pytest.mark.skipif(not HAS_PROC_IO, reason="needs /proc/self/io")
def test_mapped_path_takes_its_bytes_from_the_mapping_not_read_calls(ckpts: dict[str, str]) -> None:
    reader, spent = _load(ckpts["mmap"], direct_reads=False)
    assert reader.bytes_read == _stored(ckpts["mmap"])
    assert spent < _overhead(ckpts["mmap"]), spent


def test_each_load_counts_afresh(ckpts: dict[str, str]) -> None:
    reader = MmapReader(ckpts["mmap"])
    for _ in range(2):
        dcp_load(_targets(_state()), reader)
        assert reader.bytes_read == _stored(ckpts["mmap"])


class _FirstRowsOfA(DefaultLoadPlanner):
    """Loads only ``a``'s first 100 rows: a region narrowed out of one stored chunk."""

    def create_local_plan(self) -> Any:
        plan = super().create_local_plan()
        plan.items = [dataclasses.replace(i, lengths=torch.Size([100, *i.lengths[1:]]))
                      for i in plan.items if i.storage_index.fqn == "a"]
        return plan


@pytest.mark.parametrize("direct_reads", [True, False])
def test_a_partial_load_counts_only_what_it_took(ckpts: dict[str, str], direct_reads: bool) -> None:
    reader = MmapReader(ckpts["mmap"], direct_reads=direct_reads)
    full = _state()["a"]
    targets = {"a": torch.zeros_like(full)}
    dcp.load(targets, storage_reader=reader, planner=_FirstRowsOfA(), no_dist=True)
    assert_bitwise_equal(targets["a"][:100], full[:100], "a[:100]")
    assert not targets["a"][100:].any()
    assert reader.bytes_read == 100 * full.shape[1] * full.element_size()


def test_counter_merges_passes_over_one_record() -> None:
    c = BytesRead()
    c.take("f", 0, 100, 30)
    c.take("f", 0, 100, 30)
    c.take("f", 128, 50, 20)
    assert c.total == 60 + 20
    c.take("f", 0, 100, 90)  # parts never count past the record
    c.take("f", 128, 50)  # read whole: its parts are inside that read
    assert c.total == 100 + 50
    c.take("g", 0, 100, 10)  # another file
    assert c.total == 160
    c.clear()
    assert c.total == 0


@pytest.mark.parametrize("kind", ["mmap", "stock"])
def test_read_once_in_one_process_is_the_plain_load(ckpts: dict[str, str], kind: str) -> None:
    """One plan: nothing is shared, nothing is sent (no process group is needed)."""
    reader, _ = _load(ckpts[kind], read_once=True)
    assert reader.bytes_read == _stored(ckpts[kind])


def test_read_once_arguments_are_checked(ckpts: dict[str, str]) -> None:
    with pytest.raises(ValueError, match="read_once_piece_bytes"):
        MmapReader(ckpts["mmap"], read_once=True, read_once_piece_bytes=0)
    with pytest.raises(ValueError, match="read_once_min_share"):
        MmapReader(ckpts["mmap"], read_once=True, read_once_min_share=2.0)
