"""Hash on second sight (a local root): chunks are written with their CRC-32 alone; a later save compares a
chunk that may equal an unhashed stored one byte for byte with the stored bytes, refers to it only where every
byte is equal, and keeps the BLAKE3 hash it computed so that the same manager's next save matches by hash."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import mmapckpt
from helpers import assert_bitwise_equal
from mmapckpt import CheckpointManager
from mmapckpt.dcp import reuse
from mmapckpt.format import layout as fmt
from mmapckpt.reading.shard import Shard
from roots import files_of, make_root, save_step

pytest.importorskip("blake3")


def _state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    sd: dict[str, Any] = {"frozen.w": torch.randn(256, 256, generator=g),  # 256 KiB: past the 64 KiB head
                          "frozen.b": torch.randn(64, generator=g).bfloat16()}
    sd["head.w"] = torch.full((64, 8), float(step))
    return sd


@pytest.fixture
def compared(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The stored chunks' files the saves compared bytes with, in order."""
    seen: list[str] = []
    real = reuse._comparer

    def counting(storage: Any) -> Any:
        compare = real(storage)

        def spy(r: Any, buf: Any) -> Any:
            seen.append(r.file)
            return compare(r, buf)
        return spy

    monkeypatch.setattr(reuse, "_comparer", counting)
    return seen


def _headers_have_no_hash(step_dir: Path) -> bool:
    for p in step_dir.glob("*.distcp"):
        shard = Shard(str(p))
        try:
            if shard.hashes() or shard.header.minor != fmt.FORMAT_MINOR:
                return False
        finally:
            shard.close()
    return True


def test_a_chunk_equal_but_unhashed_is_compared_then_referenced(tmp_path: Path, compared: list[str]) -> None:
    root = make_root(tmp_path / "root")
    save_step(root, 1, _state(1))
    save_step(root, 2, _state(2), reuse=(1,))
    for s in (1, 2):
        assert _headers_have_no_hash(root / f"step-{s}"), s
    files = files_of(root / "step-2")
    assert files["frozen.w"] == files["frozen.b"] == "../step-1/__0_0.distcp" and files["head.w"] == "__0_0.distcp"
    # head.w too: step 1's header records no head CRC-32, so every chunk of the same name and shape is compared
    assert sorted(compared) == ["../step-1/__0_0.distcp"] * 3
    got = mmapckpt.load(root / "step-2")
    for k, v in _state(2).items():
        assert_bitwise_equal(got[k], v, k) if isinstance(v, torch.Tensor) else None
    assert mmapckpt.verify_checkpoint(root / "step-2").ok


def test_a_chunk_with_an_equal_head_but_another_byte_later_is_written(tmp_path: Path) -> None:
    root = make_root(tmp_path / "root")
    save_step(root, 1, _state(1))
    sd = _state(1)
    sd["frozen.w"] = sd["frozen.w"].clone()
    sd["frozen.w"][255, 255] = -sd["frozen.w"][255, 255]  # the last 4 bytes of 256 KiB: the head is the same
    save_step(root, 2, sd, reuse=(1,))
    files = files_of(root / "step-2")
    assert files["frozen.w"] == "__0_0.distcp" and files["frozen.b"] == "../step-1/__0_0.distcp"
    got = mmapckpt.load(root / "step-2")
    assert_bitwise_equal(got["frozen.w"], sd["frozen.w"])
    assert_bitwise_equal(got["frozen.b"], sd["frozen.b"])


def test_a_manager_compares_once_then_matches_by_the_hash_it_kept(tmp_path: Path, compared: list[str]) -> None:
    manager = CheckpointManager(tmp_path / "root")
    manager.save(_state(1), 1)
    manager.save(_state(2), 2)
    assert compared.count("../step-1/__0_0.distcp") == 2  # frozen.w and frozen.b (head.w: another head)
    compared.clear()
    manager.save(_state(3), 3)
    assert compared == []  # matched by the hashes kept from step 2's comparison
    files = files_of(tmp_path / "root" / "step-3")
    assert files["frozen.w"] == files["frozen.b"] == "../step-1/__0_0.distcp"
    # a resumed job has no hashes kept: it compares again, once (head.w too: no head CRC is on disk to tell it
    # changed; its bytes differ and it is written)
    resumed = CheckpointManager(tmp_path / "root")
    resumed.save(_state(4), 4)
    assert sorted(compared) == ["../step-1/__0_0.distcp"] * 2 + ["../step-3/__0_0.distcp"]
    assert files_of(tmp_path / "root" / "step-4")["head.w"] == "__0_0.distcp"
    compared.clear()
    resumed.save(_state(5), 5)
    assert compared == []
    target = {k: torch.zeros_like(v) for k, v in _state(5).items()}
    assert resumed.load(target) == 5
    for k, v in target.items():
        assert_bitwise_equal(v, _state(5)[k], k)


def test_a_root_with_hashes_serves_as_a_reuse_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     compared: list[str]) -> None:
    root = make_root(tmp_path / "root")
    with monkeypatch.context() as m:  # step 1 as main wrote every step (and an object store still does)
        m.setattr(reuse, "_reads_cheaply", lambda storage: False)
        save_step(root, 1, _state(1))
    assert set(Shard(str(root / "step-1" / "__0_0.distcp")).hashes()) == {
        ("frozen.w", (0, 0)), ("frozen.b", (0,)), ("head.w", (0, 0))}
    save_step(root, 2, _state(2), reuse=(1,))
    assert compared == []  # matched by the recorded hashes
    files = files_of(root / "step-2")
    assert files["frozen.w"] == files["frozen.b"] == "../step-1/__0_0.distcp" and files["head.w"] == "__0_0.distcp"
    assert _headers_have_no_hash(root / "step-2")
    got = mmapckpt.load(root / "step-2")
    assert_bitwise_equal(got["head.w"], _state(2)["head.w"])
    assert_bitwise_equal(got["frozen.w"], _state(2)["frozen.w"])


def test_a_resumed_job_reads_only_the_head_of_a_stored_chunk_that_changed(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from mmapckpt.storage.local import LocalFile
    root = make_root(tmp_path / "root")
    save_step(root, 1, _state(1))
    shard = Shard(str(root / "step-1" / "__0_0.distcp"))
    e = shard.header.by_key()[("frozen.w", (0, 0))]
    shard.close()
    reads: list[tuple[int, int]] = []
    real = LocalFile.read_into

    def spy(self: Any, offset: int, buf: Any, **kw: Any) -> None:
        if self.path.endswith("step-1/__0_0.distcp") and e.offset <= offset < e.offset + e.length:
            reads.append((offset, len(buf)))
        real(self, offset, buf, **kw)

    monkeypatch.setattr(LocalFile, "read_into", spy)
    sd = _state(2)
    sd["frozen.w"] = -sd["frozen.w"]  # changed from its first byte on; no head CRC-32 on disk to tell
    save_step(root, 2, sd, reuse=(1,))
    assert files_of(root / "step-2")["frozen.w"] == "__0_0.distcp"
    assert reads == [(e.offset, fmt.HEAD_BYTES)]  # its head alone was read, not the 256 KiB
    assert_bitwise_equal(mmapckpt.load(root / "step-2")["frozen.w"], sd["frozen.w"])
