"""The first load through the cache reads each range of a file while the rest is fetched (storage/cache/filling.py),
and only once its bytes are in and checked. On ``unmapped://`` (tests/unmapped.py): no server needed."""

from __future__ import annotations

import os
import threading

import pytest
import torch
from unmapped import medium, url  # noqa: F401  (medium: the unmapped:// fixture)

import mmapckpt
from mmapckpt.errors import ChecksumError
from mmapckpt.storage.cache import entry, filling
from mmapckpt.storage.cache.entry import Entry


def _sd() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {f"t{i}": torch.randn(64 << 10, generator=g) for i in range(24)}  # 24 x 256 KiB


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert set(a) == set(b) and all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)


def test_the_first_load_copies_into_its_targets_while_the_rest_is_fetched(medium, tmp_path, monkeypatch):  # noqa: F811
    """The medium holds back the file's last window until the load has copied a range out of the copy being
    fetched: the load gets its first bytes before the fetch is over (without the overlap it would read only after
    the whole file, and the medium's wait would time out). The copy is then in place, checked, and loads bitwise."""
    from unmapped import _UnmappedFile

    monkeypatch.setattr(entry, "_WINDOW", 512 << 10)
    sd = _sd()
    mmapckpt.save(sd, tmp_path / "ck")
    shard = str(tmp_path / "ck" / "__0_0.distcp")
    size = os.path.getsize(shard)
    copied, held_back = threading.Event(), []
    copy_out = filling.Filling.copy_out

    def spy_copy(self, offset, buf):  # noqa: ANN001
        copy_out(self, offset, buf)
        if self.entry.url.endswith(shard) and memoryview(buf).nbytes == 256 << 10:  # a tensor (not the header)
            copied.set()
    monkeypatch.setattr(filling.Filling, "copy_out", spy_copy)
    read_into = _UnmappedFile.read_into

    def held(self, offset, buf, *, entry=None):  # noqa: ANN001
        if self.path.endswith(shard) and offset + memoryview(buf).nbytes == size:
            held_back.append(copied.wait(20))  # the last window: only once the load has read something
        read_into(self, offset, buf, entry=entry)
    monkeypatch.setattr(_UnmappedFile, "read_into", held)
    cache = str(tmp_path / "cache")
    targets = {k: torch.zeros_like(v) for k, v in sd.items()}
    mmapckpt.load_into(targets, url(tmp_path / "ck"), storage_options={"cache_dir": cache})
    _same(targets, sd)
    assert held_back == [True]
    rec = Entry(cache, url(shard)).read_record()
    assert rec is not None and rec["check"] == "crc32"
    fetched = medium[0]
    _same(mmapckpt.load(url(tmp_path / "ck"), storage_options={"cache_dir": cache}), sd)
    assert medium[0] == fetched  # the copy serves the next load


def test_a_range_is_served_only_once_its_entries_are_checked(medium, tmp_path, monkeypatch):  # noqa: F811
    """A bit flipped on the way in, in an entry that spans windows: the load into targets fails with ChecksumError
    (it is never handed bytes that failed, or have not yet passed, their CRC-32), and nothing is cached."""
    from unmapped import _UnmappedFile

    monkeypatch.setattr(entry, "_WINDOW", 96 << 10)  # each 256 KiB entry spans windows
    sd = _sd()
    mmapckpt.save(sd, tmp_path / "ck")
    shard = str(tmp_path / "ck" / "__0_0.distcp")
    size = os.path.getsize(shard)
    flip = size // 2
    read_into = _UnmappedFile.read_into

    def flipped(self, offset, buf, *, entry=None):  # noqa: ANN001
        read_into(self, offset, buf, entry=entry)
        mv = memoryview(buf).cast("B")
        if self.path.endswith(shard) and offset <= flip < offset + len(mv):
            mv[flip - offset] ^= 0x04
    monkeypatch.setattr(_UnmappedFile, "read_into", flipped)
    cache = str(tmp_path / "cache")
    for _ in range(2):
        targets = {k: torch.zeros_like(v) for k, v in sd.items()}
        with pytest.raises(ChecksumError, match="not cached"):
            mmapckpt.load_into(targets, url(tmp_path / "ck"), storage_options={"cache_dir": cache})
        e = Entry(cache, url(shard))
        assert e.read_record() is None and sorted(os.listdir(e.dir)) == ["#lock"]


def test_a_fetch_that_fails_midway_raises_checkpoint_error_naming_the_url_and_caches_nothing(
        medium, tmp_path, monkeypatch):  # noqa: F811
    """An error that is not the medium's own CheckpointError (here an OSError from a read of the file's second
    half) ends the first load with CheckpointError naming the remote file, and leaves no copy in the cache."""
    import errno

    from unmapped import _UnmappedFile

    from mmapckpt.errors import CheckpointError

    monkeypatch.setattr(entry, "_WINDOW", 96 << 10)
    sd = _sd()
    mmapckpt.save(sd, tmp_path / "ck")
    shard = str(tmp_path / "ck" / "__0_0.distcp")
    half = os.path.getsize(shard) // 2
    read_into = _UnmappedFile.read_into

    def failing(self, offset, buf, *, entry=None):  # noqa: ANN001
        if self.path.endswith(shard) and offset >= half:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        read_into(self, offset, buf, entry=entry)
    monkeypatch.setattr(_UnmappedFile, "read_into", failing)
    cache = str(tmp_path / "cache")
    targets = {k: torch.zeros_like(v) for k, v in sd.items()}
    with pytest.raises(CheckpointError, match="the fetch into the cache failed") as info:
        mmapckpt.load_into(targets, url(tmp_path / "ck"), storage_options={"cache_dir": cache})
    assert info.value.path == url(shard)
    assert isinstance(info.value.__cause__, OSError) and info.value.__cause__.errno == errno.EIO
    e = Entry(cache, url(shard))
    assert e.read_record() is None and sorted(os.listdir(e.dir)) == ["#lock"]
