"""A CheckpointManager reads each reused shard header once across its saves (dcp/reuse.py ``HeaderCache``),
and again whenever the file is no longer the one it read: a damaged header is still refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from helpers import assert_bitwise_equal
from mmapckpt import CheckpointError, CheckpointManager
from mmapckpt.dcp import reuse
from mmapckpt.dcp.unwrap import checkpoint_error
from mmapckpt.reading.shard import Shard
from roots import files_of, frozen_and_trained

pytest.importorskip("blake3")


def _state(step: int) -> dict[str, Any]:
    sd = frozen_and_trained()
    sd["head.w"] = torch.full((64, 8), float(step))  # changed by every step; the frozen ones never
    return sd


@pytest.fixture
def decoded(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The paths of the shard headers the reuse index decodes, in order."""
    seen: list[str] = []
    real = reuse.shard_of

    def counting(f: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append(f.path)
        return real(f, *args, **kwargs)

    monkeypatch.setattr(reuse, "shard_of", counting)
    return seen


def _stored_bytes(shard: Shard, key: Any) -> bytes:
    """The stored bytes of entry ``key`` of ``shard``."""
    e = shard.header.by_key()[key]
    with open(shard.path, "rb") as f:
        f.seek(e.offset)
        return f.read(e.length)


def _stored_hash(shard: Shard, key: Any) -> str:
    """BLAKE3 of the stored bytes of entry ``key`` of ``shard``."""
    from blake3 import blake3

    return blake3(_stored_bytes(shard, key)).hexdigest()


def test_a_manager_decodes_no_header_it_wrote_or_read_before(tmp_path: Path, decoded: list[str]) -> None:
    manager = CheckpointManager(tmp_path / "root")
    for step in (1, 2, 3):
        manager.save(_state(step), step)
    # each save compared with the step before, whose files this manager wrote: their hashes were kept as written
    assert decoded == []
    files = files_of(tmp_path / "root" / "step-3")
    assert files["frozen.w"].startswith("../step-1/") and not files["head.w"].startswith("../")
    # what was kept is what the headers say, and, for a chunk written unhashed (a local root) and then found
    # equal byte for byte by a later save, the BLAKE3 hash of its stored bytes
    kept = manager._headers._used
    assert {ref for _, ref, _ in kept} == {f"../step-{s}/{p.name}" for s in (2, 3)
                                          for p in (tmp_path / "root" / f"step-{s}").glob("*.distcp")} | {
        f"../step-1/{p.name}" for p in (tmp_path / "root" / "step-1").glob("*.distcp")}
    for (_, ref, sid), (stamp, hashes) in kept.items():
        shard = Shard(str(tmp_path / "root" / ref[3:]))
        try:
            assert shard.save_id == sid and stamp[0] == shard.size, ref
            recorded = shard.hashes(unhashed=True)
            assert {k: v[1] for k, v in recorded.items()} == {k: v[1] for k, v in hashes.items()}, ref
            for key, (digest, offset, _, tag) in hashes.items():
                assert digest == recorded[key][0] or digest == _stored_hash(shard, key), (ref, key)
                # an equality tag kept is the tag of the stored bytes (writing/tags.py)
                assert tag is None or tag == manager._headers.tagger.tag(_stored_bytes(shard, key)), (ref, key)
        finally:
            shard.close()
    target = {k: torch.zeros_like(v) for k, v in _state(3).items() if isinstance(v, torch.Tensor)}
    assert manager.load(target) == 3
    for k, v in target.items():
        assert_bitwise_equal(v, _state(3)[k])


def test_another_manager_decodes_each_header_once(tmp_path: Path, decoded: list[str]) -> None:
    CheckpointManager(tmp_path / "root").save(_state(1), 1)
    CheckpointManager(tmp_path / "root").save(_state(2), 2)  # a resumed job: step 1's header is read
    assert [Path(p).parent.name for p in decoded] == ["step-1"]
    manager = CheckpointManager(tmp_path / "root")
    decoded.clear()
    manager.save(_state(3), 3)  # step 2 refers to step 1's file and holds its own: both read, once
    assert sorted(Path(p).parent.name for p in decoded) == ["step-1", "step-2"]
    decoded.clear()
    manager.save(_state(4), 4)
    assert decoded == []


def test_a_header_that_changed_since_it_was_read_is_read_again_and_refused(tmp_path: Path,
                                                                          decoded: list[str]) -> None:
    manager = CheckpointManager(tmp_path / "root")
    manager.save(_state(1), 1)
    manager.save(_state(2), 2)  # keeps step 1's header as it wrote it
    (shard,) = (tmp_path / "root" / "step-1").glob("*.distcp")
    raw = bytearray(shard.read_bytes())
    raw[24] ^= 0xFF  # the preamble's header CRC-32: the header no longer checks
    shard.write_bytes(bytes(raw))
    decoded.clear()
    with pytest.raises(BaseException) as caught:
        manager.save(_state(3), 3)
    err = checkpoint_error(caught.value)
    assert isinstance(err, CheckpointError) and shard.name in str(err)
    assert any(Path(p).name == shard.name for p in decoded)  # decoded again, not taken from the cache
    assert manager.steps() == [1, 2]
