"""Equality tags (writing/tags.py): a manager's later saves compare a chunk whose stored bytes it tagged by the
tag alone (GMAC under a key of the process's own), hashing nothing again; a chunk that differs anywhere is
written; a resumed manager has no tags and matches by BLAKE3; tags never reach the disk."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

import mmapckpt
from helpers import assert_bitwise_equal
from mmapckpt import CheckpointManager
from mmapckpt.writing import dedup, tags
from roots import files_of, late_frozen

pytest.importorskip("blake3")
pytest.importorskip("cryptography")


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """How often a save hashed (BLAKE3, with or without a tag), compared stored bytes, or tagged alone a chunk
    that may equal a stored one."""
    seen: Counter[str] = Counter()
    for name in ("_hash_and_tag", "_compare_and_tag", "_tag_only"):
        real = getattr(dedup, name)

        def spy(*args: Any, _real: Any = real, _name: str = name) -> Any:
            seen[_name] += 1
            return _real(*args)
        monkeypatch.setattr(dedup, name, spy)
    return seen


def test_a_tag_tells_bytes_apart() -> None:
    t = tags.Tagger()
    data = bytearray(torch.randn(4096).numpy().tobytes())
    assert t.tag(data) == t.tag(bytes(data)) and len(t.tag(data)) == 16
    for pos in (0, 1, 4095, len(data) - 1):  # one bit anywhere
        other = bytearray(data)
        other[pos] ^= 0x01
        assert t.tag(other) != t.tag(data), pos
    assert len({t.tag(b""), t.tag(b"\0"), t.tag(bytes(16)), t.tag(bytes(32))}) == 4  # the length counts
    assert tags.Tagger().tag(data) != t.tag(data)  # each tagger has a key of its own
    assert "Tagger()" == repr(t)


def test_a_long_chunk_is_tagged_in_pieces_as_one(monkeypatch: pytest.MonkeyPatch) -> None:
    t = tags.Tagger()
    data = torch.randn(1000).numpy().tobytes()
    whole = t.tag(data)
    monkeypatch.setattr(tags, "_PIECE", 7)
    assert t.tag(data) == whole
    assert t.tag(data[:-1]) != whole


def test_a_manager_compares_what_it_tagged_by_the_tag_alone(tmp_path: Path, calls: Counter[str]) -> None:
    manager = CheckpointManager(tmp_path / "root")
    manager.save(late_frozen(1), 1)  # every chunk hashed and tagged as it is written
    calls.clear()
    manager.save(late_frozen(2), 2)
    # frozen.*: by their tags; late.w: its tag differs (its head too, so it is not even tagged again): written
    assert calls == Counter(_tag_only=2)
    calls.clear()
    manager.save(late_frozen(3), 3)
    # late.w, written by step 2 with its CRC-32 alone, is compared byte for byte once (and tagged meanwhile)
    assert calls == Counter(_tag_only=2, _compare_and_tag=1)
    calls.clear()
    manager.save(late_frozen(4), 4)
    assert calls == Counter(_tag_only=3)  # nothing hashed, nothing read back
    files = files_of(tmp_path / "root" / "step-4")
    assert files["frozen.w"] == "../step-1/__0_0.distcp" and files["late.w"] == "../step-2/__0_0.distcp"
    assert files["head.w"] == "__0_0.distcp"
    target = {k: torch.zeros_like(v) for k, v in late_frozen(4).items()}
    assert manager.load(target) == 4
    for k, v in target.items():
        assert_bitwise_equal(v, late_frozen(4)[k], k)
    # a resumed job has no tags: it matches frozen.* by the hashes on disk (tagging them), compares late.w and
    # head.w (no head CRC on disk tells that head.w changed) byte for byte, then matches by tag
    resumed = CheckpointManager(tmp_path / "root")
    calls.clear()
    resumed.save(late_frozen(5), 5)
    assert calls == Counter(_hash_and_tag=2, _compare_and_tag=2)
    calls.clear()
    resumed.save(late_frozen(6), 6)
    assert calls == Counter(_tag_only=3)
    assert files_of(tmp_path / "root" / "step-6")["frozen.w"] == "../step-1/__0_0.distcp"


def test_a_chunk_equal_but_for_one_late_byte_is_written(tmp_path: Path, calls: Counter[str]) -> None:
    manager = CheckpointManager(tmp_path / "root")
    manager.save(late_frozen(1), 1)
    manager.save(late_frozen(2), 2)
    sd = late_frozen(3)
    sd["frozen.w"] = sd["frozen.w"].clone()
    sd["frozen.w"][255, 255] = -sd["frozen.w"][255, 255]  # the last 4 bytes of 256 KiB: the head is the same
    calls.clear()
    manager.save(sd, 3)
    assert calls["_tag_only"] == 2 and calls["_hash_and_tag"] == 0  # compared by its tag
    files = files_of(tmp_path / "root" / "step-3")
    assert files["frozen.w"] == "__0_0.distcp" and files["frozen.b"] == "../step-1/__0_0.distcp"
    got = mmapckpt.load(tmp_path / "root" / "step-3")
    assert_bitwise_equal(got["frozen.w"], sd["frozen.w"])
    assert mmapckpt.verify_checkpoint(tmp_path / "root" / "step-3").ok


def test_tags_never_reach_the_disk(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path / "root")
    for step in (1, 2, 3):
        manager.save(late_frozen(step), step)
    kept = [h[3] for _, hashes in manager._headers._used.values() for h in hashes.values() if h[3] is not None]
    assert len(kept) >= 3
    files = [p.read_bytes() for p in (tmp_path / "root").rglob("*") if p.is_file()]
    assert files and not any(tag in data for tag in kept for data in files)


def test_without_cryptography_a_manager_matches_by_hash(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        calls: Counter[str]) -> None:
    monkeypatch.setitem(sys.modules, "cryptography.hazmat.primitives.ciphers", None)  # import fails
    manager = CheckpointManager(tmp_path / "root")
    assert manager._headers.tagger is None
    manager.save(late_frozen(1), 1)
    calls.clear()
    manager.save(late_frozen(2), 2)
    assert calls == Counter(_hash_and_tag=2)
    assert files_of(tmp_path / "root" / "step-2")["frozen.w"] == "../step-1/__0_0.distcp"
