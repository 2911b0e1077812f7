"""MmapReader's walk of the plain items of a plan (dcp/read_paths.py ``_read_items``).

A shard of the metadata's own save is opened as ``load_into`` opens it (its header compared
whole with the index, never decoded), and each item deferred to a direct read is committed
with its own target when the read is done.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from helpers import assert_bitwise_equal, dcp_save
from mmapckpt import FastLoadPlanner, MmapReader, MmapWriter
from mmapckpt.format import layout


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    sd: dict[str, Any] = {f"big.{i}": torch.randn(256, 256, generator=g) for i in range(4)}  # 256 KB: direct reads
    sd.update({f"small.{i}": torch.randn(7, generator=g).to(torch.bfloat16) for i in range(5)})
    sd["param"] = torch.nn.Parameter(torch.randn(128, 512, generator=g))
    sd["empty"] = torch.zeros(0, 3)
    return sd


def _targets(sd: dict[str, Any]) -> dict[str, Any]:
    return {k: torch.nn.Parameter(torch.zeros_like(v)) if isinstance(v, torch.nn.Parameter) else torch.zeros_like(v)
            for k, v in sd.items()}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("walk") / "ck")
    dcp_save(_state(), MmapWriter(path, thread_count=2))  # two shard files
    return path


@pytest.mark.parametrize("planner", [FastLoadPlanner, DefaultLoadPlanner])
@pytest.mark.parametrize("threads", [1, 2])
def test_shards_of_the_metadatas_save_are_not_decoded(ckpt: str, planner: type, threads: int,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    def decoded(*a: Any, **k: Any) -> Any:
        raise AssertionError("a shard header was decoded")

    monkeypatch.setattr(layout, "decode_header_doc", decoded)
    sd, targets = _state(), _targets(_state())
    dcp.load(targets, storage_reader=MmapReader(ckpt, thread_count=threads), planner=planner(), no_dist=True)
    for k, v in sd.items():
        assert_bitwise_equal(targets[k].detach(), v.detach(), k)


def test_each_deferred_item_is_committed_with_its_own_target(ckpt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    commits: list[tuple[str, int, tuple[int, ...], bool]] = []

    def commit_tensor(self: Any, read_item: Any, tensor: torch.Tensor) -> None:
        commits.append((read_item.dest_index.fqn, tensor.data_ptr(), tuple(tensor.shape), tensor.requires_grad))

    # on DefaultLoadPlanner itself: FastLoadPlanner still "commits nothing of its own", so its reads are deferred
    monkeypatch.setattr(DefaultLoadPlanner, "commit_tensor", commit_tensor)
    targets = _targets(_state())
    dcp.load(targets, storage_reader=MmapReader(ckpt), planner=FastLoadPlanner(), no_dist=True)
    want = sorted((k, t.data_ptr(), tuple(t.shape), False) for k, t in targets.items() if t.numel())
    assert sorted(commits) == want
    for k, v in _state().items():
        assert_bitwise_equal(targets[k].detach(), v.detach(), k)
