"""The manager stores a chunk that did not change since the newest step once (MmapWriter(reuse=), dcp/reuse.py),
and retention keeps the bytes a retained step refers to after the step that wrote them is dropped."""

from __future__ import annotations

import pytest
import torch
from manage_data import same, stored_files

import mmapckpt

pytest.importorskip("blake3")

FROZEN = 1 << 18  # float32 elements: 1 MiB that never changes
TRAINED = 1 << 12  # 16 KiB that changes at every step


def _state(step: int) -> dict[str, object]:
    g = torch.Generator().manual_seed(7)
    frozen = torch.randint(0, 256, (FROZEN * 4,), dtype=torch.uint8, generator=g).view(torch.float32)
    g.manual_seed(100 + step)
    trained = torch.randint(0, 256, (TRAINED * 4,), dtype=torch.uint8, generator=g).view(torch.float32)
    return {"frozen.w": frozen, "head.w": trained, "step": step}


def _blank() -> dict[str, object]:
    return {"frozen.w": torch.zeros(FROZEN), "head.w": torch.zeros(TRAINED), "step": -1}


def test_unchanged_chunks_are_stored_once_and_outlive_the_step_that_wrote_them(medium):
    m = mmapckpt.CheckpointManager(medium.root, keep_last=2, storage_options=medium.options)
    for step in range(1, 6):
        m.save(_state(step), step)
    assert m.steps() == [4, 5]
    for step in (4, 5):  # step 1, which wrote the frozen bytes, is gone; its bytes stay while 4 and 5 name them
        got = _blank()
        m.load(got, step)
        assert same(got, _state(step))
    files = stored_files(medium.root, medium.client)
    assert not any(name.startswith(("step-2/", "step-3/")) for name in files), files
    assert any(name.startswith("step-1/") for name in files)  # the shard holding the frozen chunk
    stored = sum(size for name, size in files.items() if name.startswith("step-"))
    assert stored < FROZEN * 4 + 4 * (TRAINED * 4) + (1 << 18), stored  # the frozen MiB once, not three times
    views = mmapckpt.load(m.path(5), storage_options=medium.options)  # the referenced bytes, read by every entry point
    assert torch.equal(views["frozen.w"].view(torch.uint8), _state(5)["frozen.w"].view(torch.uint8))
