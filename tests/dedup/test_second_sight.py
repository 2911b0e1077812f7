"""Hash on second sight (a local root): the first step of a root is hashed; chunks later saves write get their
CRC-32 alone; a later save compares a chunk that may equal an unhashed stored one byte for byte with the stored
bytes, refers to it only where every byte is equal, and keeps the BLAKE3 hash it computed so that the same
manager's next save matches by hash."""

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
from roots import files_of, late_frozen, make_root, save_step

pytest.importorskip("blake3")


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


def _hashed(step_dir: Path) -> set[str]:
    shard = Shard(str(step_dir / "__0_0.distcp"))
    try:
        return {fqn for fqn, _ in shard.hashes()}
    finally:
        shard.close()


def test_the_first_step_is_hashed_and_its_frozen_chunks_are_never_compared(tmp_path: Path,
                                                                           compared: list[str]) -> None:
    """The first step of a local root records every chunk's hash: the chunks frozen from it on are matched by the
    hashes on disk by every later save, a restarted job's included, and their bytes are never read back."""
    root = tmp_path / "root"
    manager = CheckpointManager(root)
    manager.save(late_frozen(1), 1)
    assert _hashed(root / "step-1") == {"frozen.w", "frozen.b", "late.w", "head.w"}
    manager.save(late_frozen(2), 2)
    assert compared == []  # frozen.*: by hash; late.w, head.w: their heads changed
    assert _headers_have_no_hash(root / "step-2")  # what a later save writes: its CRC-32 alone
    resumed = CheckpointManager(root)  # nothing kept in memory
    resumed.save(late_frozen(3), 3)
    assert "../step-1/__0_0.distcp" not in compared  # frozen.* matched by step 1's hashes on disk
    files = files_of(root / "step-3")
    assert files["frozen.w"] == files["frozen.b"] == "../step-1/__0_0.distcp"
    assert files["late.w"] == "../step-2/__0_0.distcp" and files["head.w"] == "__0_0.distcp"


def test_a_chunk_equal_but_unhashed_is_compared_then_referenced(tmp_path: Path, compared: list[str]) -> None:
    root = make_root(tmp_path / "root")
    save_step(root, 1, late_frozen(1))
    save_step(root, 2, late_frozen(2), reuse=(1,))
    assert compared == [] and _headers_have_no_hash(root / "step-2")
    save_step(root, 3, late_frozen(3), reuse=(2,))
    assert _headers_have_no_hash(root / "step-3")
    files = files_of(root / "step-3")
    assert files["frozen.w"] == files["frozen.b"] == "../step-1/__0_0.distcp"  # by step 1's hashes
    assert files["late.w"] == "../step-2/__0_0.distcp" and files["head.w"] == "__0_0.distcp"
    # late.w compared and equal; head.w compared too: step 2's header records no head CRC-32 to tell it changed
    assert sorted(compared) == ["../step-2/__0_0.distcp"] * 2
    got = mmapckpt.load(root / "step-3")
    for k, v in late_frozen(3).items():
        assert_bitwise_equal(got[k], v, k)
    assert mmapckpt.verify_checkpoint(root / "step-3").ok


def test_a_chunk_with_an_equal_head_but_another_byte_later_is_written(tmp_path: Path) -> None:
    root = make_root(tmp_path / "root")
    save_step(root, 1, late_frozen(1))
    save_step(root, 2, late_frozen(2), reuse=(1,))
    sd = late_frozen(3)
    sd["late.w"] = sd["late.w"].clone()
    sd["late.w"][255, 255] = -sd["late.w"][255, 255]  # the last 4 bytes of 256 KiB: the head is the same
    save_step(root, 3, sd, reuse=(2,))
    files = files_of(root / "step-3")
    assert files["late.w"] == "__0_0.distcp" and files["frozen.w"] == "../step-1/__0_0.distcp"
    got = mmapckpt.load(root / "step-3")
    assert_bitwise_equal(got["late.w"], sd["late.w"])
    assert_bitwise_equal(got["frozen.w"], sd["frozen.w"])


def test_a_manager_compares_once_then_matches_by_the_hash_it_kept(tmp_path: Path, compared: list[str]) -> None:
    manager = CheckpointManager(tmp_path / "root")
    manager.save(late_frozen(1), 1)
    manager.save(late_frozen(2), 2)
    assert compared == []
    manager.save(late_frozen(3), 3)
    assert compared == ["../step-2/__0_0.distcp"]  # late.w (equal); head.w: the head CRC the manager kept
    compared.clear()
    manager.save(late_frozen(4), 4)
    assert compared == []  # late.w: by the hash kept from step 3's comparison; head.w: by the head CRC kept
    files = files_of(tmp_path / "root" / "step-4")
    assert files["late.w"] == "../step-2/__0_0.distcp" and files["frozen.w"] == "../step-1/__0_0.distcp"
    # a resumed job has no hashes kept: it compares late.w again, once (and head.w: no head CRC is on disk to
    # tell it changed; its bytes differ and it is written); frozen.*: by step 1's hashes, never compared
    resumed = CheckpointManager(tmp_path / "root")
    resumed.save(late_frozen(5), 5)
    assert sorted(compared) == ["../step-2/__0_0.distcp", "../step-4/__0_0.distcp"]
    assert files_of(tmp_path / "root" / "step-5")["head.w"] == "__0_0.distcp"
    compared.clear()
    resumed.save(late_frozen(6), 6)
    assert compared == []
    target = {k: torch.zeros_like(v) for k, v in late_frozen(6).items()}
    assert resumed.load(target) == 6
    for k, v in target.items():
        assert_bitwise_equal(v, late_frozen(6)[k], k)


def test_a_step_with_hashes_serves_as_a_reuse_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     compared: list[str]) -> None:
    root = make_root(tmp_path / "root")
    save_step(root, 1, late_frozen(1))
    with monkeypatch.context() as m:  # step 2 as main wrote every step (and an object store still does)
        m.setattr(reuse, "_reads_cheaply", lambda storage: False)
        save_step(root, 2, late_frozen(2), reuse=(1,))
    assert _hashed(root / "step-2") == {"late.w", "head.w"}
    save_step(root, 3, late_frozen(3), reuse=(2,))
    assert compared == []  # matched by the recorded hashes (head.w: by its recorded head CRC)
    files = files_of(root / "step-3")
    assert files["late.w"] == "../step-2/__0_0.distcp" and files["head.w"] == "__0_0.distcp"
    assert _headers_have_no_hash(root / "step-3")
    got = mmapckpt.load(root / "step-3")
    assert_bitwise_equal(got["head.w"], late_frozen(3)["head.w"])
    assert_bitwise_equal(got["late.w"], late_frozen(3)["late.w"])


def test_a_resumed_job_reads_only_the_head_of_a_stored_chunk_that_changed(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from mmapckpt.storage.local import LocalFile
    root = make_root(tmp_path / "root")
    save_step(root, 1, late_frozen(1))
    save_step(root, 2, late_frozen(2), reuse=(1,))  # late.w written again, unhashed
    shard = Shard(str(root / "step-2" / "__0_0.distcp"))
    e = shard.header.by_key()[("late.w", (0, 0))]
    shard.close()
    reads: list[tuple[int, int]] = []
    real = LocalFile.read_into

    def spy(self: Any, offset: int, buf: Any, **kw: Any) -> None:
        if self.path.endswith("step-2/__0_0.distcp") and e.offset <= offset < e.offset + e.length:
            reads.append((offset, len(buf)))
        real(self, offset, buf, **kw)

    monkeypatch.setattr(LocalFile, "read_into", spy)
    sd = late_frozen(3)
    sd["late.w"] = -sd["late.w"]  # changed from its first byte on; no head CRC-32 on disk to tell
    save_step(root, 3, sd, reuse=(2,))
    assert files_of(root / "step-3")["late.w"] == "__0_0.distcp"
    assert reads == [(e.offset, fmt.HEAD_BYTES)]  # its head alone was read, not the 256 KiB
    assert_bitwise_equal(mmapckpt.load(root / "step-3")["late.w"], sd["late.w"])
