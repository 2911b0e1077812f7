"""The guards around hashing: a root without ``blake3`` saves every step whole, and a chunk whose first
64 KiB changed is written without waiting for its whole hash (the head's CRC-32 pre-check)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers import assert_bitwise_equal
from mmapckpt import CheckpointManager
from mmapckpt.format import layout as fmt
from mmapckpt.writing.dedup import Reusable, ReuseIndex
from mmapckpt.writing.shard import ShardEntry
from roots import files_of, frozen_and_trained


def test_without_blake3_a_manager_saves_every_step_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "blake3", None)  # find_spec says None, import raises ImportError
    manager = CheckpointManager(tmp_path / "root")
    sd = frozen_and_trained()
    manager.save(sd, 1)
    manager.save(sd, 2)  # nothing changed, and still nothing referenced: there is no hash to compare
    for step in (1, 2):
        assert not any(f.startswith("../") for f in files_of(tmp_path / "root" / f"step-{step}").values())
        (shard,) = (tmp_path / "root" / f"step-{step}").glob("*.distcp")
        assert b'"blake3"' not in shard.read_bytes()[:8192]
    target: dict[str, Any] = {k: torch.zeros_like(v) for k, v in sd.items() if isinstance(v, torch.Tensor)}
    assert manager.load(target) == 2
    for k, v in target.items():
        assert_bitwise_equal(v, sd[k], k)


def _entry(shape: tuple[int, ...]) -> ShardEntry:
    return ShardEntry("w", (0,) * len(shape), fmt.KIND_TENSOR, "float32", shape, 4 * shape[0], None)


def test_only_a_chunk_whose_head_is_unchanged_waits_for_its_whole_hash() -> None:
    e = _entry((1 << 18,))
    stored = Reusable("ab" * 32, "../step-1/f", 4096, e.length, "float32", e.shape, head=1234)
    index = ReuseIndex({(e.fqn, e.chunk_offsets): stored}, {"../step-1/f": "sid"})
    assert index.candidate(e, 1234)
    assert not index.candidate(e, 1235)  # another head: changed, written at once
    assert ReuseIndex({(e.fqn, e.chunk_offsets): stored._replace(head=None)}, {}).candidate(e, 1235)  # no head kept
    assert not index.candidate(_entry((1 << 17,)), 1234)  # another shape
    assert index.match(e, "ab" * 32) is not None and index.match(e, "cd" * 32) is None
