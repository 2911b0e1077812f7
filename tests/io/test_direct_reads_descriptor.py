"""Direct reads go through the descriptor the file was opened and mapped with, never through its path again:
a file renamed over the path (or the path removed) between open and read is never read, and the reads still
serve the original file."""

from __future__ import annotations

import os

import pytest
import torch

from mmapckpt.io import direct_reads
from mmapckpt.io.direct_reads import DirectReads
from mmapckpt.storage.local import LocalFile

_N = 1 << 18  # int32 elements: 1 MiB, above the size under which a cached file is copied rather than read


@pytest.mark.parametrize("cold", [False, True])
@pytest.mark.parametrize("then", ["replaced", "removed"])
def test_a_file_changed_at_its_path_after_open_is_never_read(tmp_path, monkeypatch, cold, then) -> None:
    if cold:
        monkeypatch.setattr(direct_reads, "is_cached", lambda fd, offsets: False)
    path = tmp_path / "shard"
    original = torch.arange(_N, dtype=torch.int32)
    path.write_bytes(original.numpy().tobytes())
    stored = LocalFile(str(path))
    mapping = stored.mapping
    src = mapping.view(0, torch.int32, (_N,))
    if then == "replaced":
        other = tmp_path / "other"
        other.write_bytes((-original).numpy().tobytes())
        os.replace(other, path)
    else:
        path.unlink()
    reads = DirectReads(mapping, ranges=[(0, _N * 4)])
    try:
        target = torch.zeros(_N, dtype=torch.int32)
        assert reads.enabled, "direct reads were given up: the file was looked up by its path again"
        assert reads.take(src, target, "t", "t")
        assert [tok for tok, _ in reads.run()] == ["t"]
    finally:
        reads.close()
        stored.close()
    assert torch.equal(target, original)
