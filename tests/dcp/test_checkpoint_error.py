"""mmapckpt.checkpoint_error: the typed error behind what dcp.save/dcp.load raise."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp

import mmapckpt


def _raised(fn) -> BaseException:
    with pytest.raises(BaseException) as info:  # CheckpointException is a BaseException
        fn()
    return info.value


def test_a_missing_checkpoint_comes_back_typed_with_the_reader(tmp_path):
    reader = mmapckpt.MmapReader(tmp_path / "nothing")
    e = _raised(lambda: dcp.load({"w": torch.zeros(2)}, storage_reader=reader, no_dist=True))
    assert isinstance(mmapckpt.checkpoint_error(e), AssertionError)  # all DCP keeps without the reader
    err = mmapckpt.checkpoint_error(e, reader)
    assert isinstance(err, mmapckpt.CheckpointNotFoundError) and "no checkpoint directory here" in str(err)


def test_errors_inside_the_reads_and_writes_come_back_typed(tmp_path):
    path = tmp_path / "c"
    dcp.save({"w": torch.arange(64.0)}, storage_writer=mmapckpt.MmapWriter(path), no_dist=True)
    e = _raised(lambda: dcp.save({"w": torch.ones(1)}, storage_writer=mmapckpt.MmapWriter(path, overwrite=False),
                                 no_dist=True))
    assert isinstance(mmapckpt.checkpoint_error(e), mmapckpt.CheckpointExistsError)
    shard = next(p for p in path.iterdir() if p.name.endswith(".distcp"))
    with mmapckpt.open(path) as f:
        off = f.metadata("w").chunks[0].file_offset
    raw = bytearray(shard.read_bytes())
    raw[off + 5] ^= 1  # a bit of w's data
    shard.write_bytes(bytes(raw))
    reader = mmapckpt.MmapReader(path, verify=True)
    e = _raised(lambda: dcp.load({"w": torch.zeros(64)}, storage_reader=reader, no_dist=True))
    err = mmapckpt.checkpoint_error(e, reader)
    assert isinstance(err, mmapckpt.ChecksumError) and err.entry == "w@[0]"


def test_anything_else_comes_back_as_it_is():
    e = ValueError("x")
    assert mmapckpt.checkpoint_error(e) is e
