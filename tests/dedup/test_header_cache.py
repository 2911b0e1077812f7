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


def test_a_later_save_decodes_only_the_header_it_has_not_read(tmp_path: Path, decoded: list[str]) -> None:
    manager = CheckpointManager(tmp_path / "root")
    for step in (1, 2, 3):
        decoded.clear()
        manager.save(_state(step), step)
    # step 3 reused step 2: its metadata names step 1's file (the frozen chunks) and step 2's own (head.w);
    # step 1's header was decoded by step 2's save, so only step 2's file is decoded now
    assert [Path(p).parent.name for p in decoded] == ["step-2"]
    files = files_of(tmp_path / "root" / "step-3")
    assert files["frozen.w"].startswith("../step-1/") and not files["head.w"].startswith("../")
    target = {k: torch.zeros_like(v) for k, v in _state(3).items() if isinstance(v, torch.Tensor)}
    assert manager.load(target) == 3
    for k, v in target.items():
        assert_bitwise_equal(v, _state(3)[k])


def test_a_header_that_changed_since_it_was_read_is_read_again_and_refused(tmp_path: Path,
                                                                          decoded: list[str]) -> None:
    manager = CheckpointManager(tmp_path / "root")
    manager.save(_state(1), 1)
    manager.save(_state(2), 2)  # reads step 1's header
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
