"""``mmapckpt.load`` on the CPU reads the selection ahead by default (reading/read_ahead.py): each file
advised to be read in order, and MADV_WILLNEED on each run of adjacent chunks, where the selection fits in
half of the available memory; ``prefetch=False`` gives no hint. Every load is compared bit for bit."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

import mmapckpt
from mmapckpt.bench.system import cached_fraction, evict
from mmapckpt.format.entries import ChunkInfo, EntryInfo
from mmapckpt.reading import read_ahead as ra


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {f"w{i}": torch.randn(256, 1024, generator=g) for i in range(16)}  # 16 MiB


def _shards(path: Path) -> list[str]:
    return sorted(str(p) for p in path.iterdir() if p.name.endswith(".distcp"))


def _info(name: str, *chunks: tuple[str, int, int]) -> EntryInfo:
    cs = tuple(ChunkInfo((0,), (n // 4,), f, o, n) for f, o, n in chunks)
    return EntryInfo(name, "tensor", "float32", (sum(n for _, _, n in chunks) // 4,), cs)


def test_runs_merge_adjacent_chunks_per_file_and_skip_places_outside_a_file() -> None:
    infos = [_info("b", ("f2", 4096, 100)), _info("a", ("f1", 1000, 64), ("f1", 0, 1000)),
             _info("c", ("f1", 1064 + (2 << 20), 8)), _info("t", ("p.pt", -3, 8)), _info("e", ("f1", 5, 0))]
    assert ra.file_runs(infos) == [ChunkInfo((), (), "f1", 0, 1064), ChunkInfo((), (), "f1", 1064 + (2 << 20), 8),
                                   ChunkInfo((), (), "f2", 4096, 100)]


class _Spy:
    def __init__(self) -> None:
        self.calls: list[tuple[ChunkInfo, int, bool]] = []

    def advise(self, c: ChunkInfo, advice: int, *, sequential: bool = False) -> None:
        self.calls.append((c, advice, sequential))


def test_read_ahead_advises_each_run_in_order_only_where_the_selection_fits_in_half_the_memory(monkeypatch) -> None:
    import mmap

    infos = [_info("a", ("f1", 0, 4096)), _info("b", ("f1", 4096, 4096)), _info("c", ("f2", 0, 4096))]
    spy = _Spy()
    monkeypatch.setattr(ra, "LEAST", 12288)
    monkeypatch.setattr(ra, "available_memory", lambda: 2 * 12288)  # exactly fits in half
    assert ra.read_ahead(spy, infos)
    assert spy.calls == [(ChunkInfo((), (), "f1", 0, 8192), mmap.MADV_WILLNEED, True),
                         (ChunkInfo((), (), "f2", 0, 4096), mmap.MADV_WILLNEED, True)]
    for avail in (2 * 12288 - 2, None):  # does not fit (it would push out what it read), or not known
        spy = _Spy()
        monkeypatch.setattr(ra, "available_memory", lambda a=avail: a)
        assert not ra.read_ahead(spy, infos)
        assert spy.calls == []


def test_a_selection_shorter_than_least_gets_no_advice(monkeypatch) -> None:
    infos = [_info("a", ("f1", 0, 4096)), _info("b", ("f2", 0, 4096))]
    monkeypatch.setattr(ra, "available_memory", lambda: 1 << 40)
    monkeypatch.setattr(ra, "LEAST", 8193)
    spy = _Spy()
    assert not ra.read_ahead(spy, infos)
    assert spy.calls == []
    monkeypatch.setattr(ra, "LEAST", 8192)
    assert ra.read_ahead(spy, infos)
    assert len(spy.calls) == 2


def test_available_memory_is_read_from_meminfo_on_linux() -> None:
    avail = ra.available_memory()
    if not os.path.exists("/proc/meminfo"):
        assert avail is None
    else:
        assert avail is not None and avail > 0


def test_a_default_load_reads_the_selection_ahead_without_a_touch_and_prefetch_false_does_not(tmp_path: Path,
                                                                                              monkeypatch) -> None:
    monkeypatch.setattr(ra, "LEAST", 1 << 20)  # 16 MiB here: read ahead as a larger selection would be
    sd = _state()
    path = tmp_path / "ckpt"
    mmapckpt.save(sd, path)
    shards = _shards(path)
    evict(shards)
    if cached_fraction(shards) != 0.0:
        pytest.skip("the page cache cannot be dropped for these files here (tmpfs?)")
    out = mmapckpt.load(path, prefetch=False)
    time.sleep(0.5)
    assert cached_fraction(shards) < 0.5  # no hint, no touch: the kernel reads almost nothing
    for k, v in sd.items():
        assert torch.equal(out[k].view(torch.int32), v.view(torch.int32))
    del out
    evict(shards)
    out = mmapckpt.load(path)
    deadline = time.monotonic() + 30
    while cached_fraction(shards) != 1.0 and time.monotonic() < deadline:  # the kernel reads it while we wait
        time.sleep(0.05)
    assert cached_fraction(shards) == 1.0
    for k, v in sd.items():
        assert torch.equal(out[k].view(torch.int32), v.view(torch.int32))


class _AdviceSpy:
    """A mapping's stand-in that records ``madvise`` calls and passes them on."""

    def __init__(self, m: object) -> None:
        self.m, self.calls = m, []

    def madvise(self, *args: int) -> None:
        self.calls.append(args)
        self.m.madvise(*args)  # type: ignore[attr-defined]


def test_read_ahead_advice_is_not_given_for_bytes_found_cached(tmp_path: Path) -> None:
    """``MappedFile.advise(MADV_WILLNEED)`` of a range whose pages are cached gives no advice (the kernel would look
    up every page only to find it there: a warm load's cost); of one whose pages are not, it does."""
    import mmap

    from mmapckpt.io.files import is_cached
    from mmapckpt.io.mapped import MappedFile

    path = tmp_path / "f"
    path.write_bytes(os.urandom(4 << 20))
    fd = os.open(path, os.O_RDONLY)
    try:
        f = MappedFile(fd, str(path))
    finally:
        os.close(fd)
    with open(path, "rb") as r:
        r.read()
    if not is_cached(f.dup(), [0, (4 << 20) - 1]):
        pytest.skip("no RWF_NOWAIT probe here: every range counts as not cached")
    spy = f._mmap = _AdviceSpy(f._mmap)  # type: ignore[assignment]
    f.advise(mmap.MADV_WILLNEED, 0, 4 << 20, sequential=True)
    assert spy.calls == []
    evict([str(path)])
    if cached_fraction([str(path)]) != 0.0:
        pytest.skip("the page cache cannot be dropped for this file here (tmpfs?)")
    f.advise(mmap.MADV_WILLNEED, 4096, 8192)
    assert spy.calls == [(mmap.MADV_WILLNEED, 4096, 8192)]
