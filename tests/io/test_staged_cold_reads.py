"""Staged loads (the accelerator path, run here on CPU targets) of a cold file read it by its read plan.

The staging buffers of a cold file are filled the way io/read_choice.py chose for its device
(``MMAPCKPT_COLD_READS`` fixes it here), by io/cold_reads.py, with the trial slices of the
first large reads timed and recorded as the CPU targets' reads are. The files are evicted
from the page cache (and the cache probe answers "cold", for file systems where eviction
cannot be seen), the bytes compared bitwise, and the way seen by spying on the runs that
io/cold_reads.py starts (that they overlap in time is not asserted: on a small machine the
reader threads may run them one after another).
"""

from __future__ import annotations

import os
import threading

import pytest
import torch

import mmapckpt
from helpers import (assert_bitwise_equal, assert_tree_equal, dcp_failure, dcp_load, dcp_save, refuse_o_direct,
                     seeded_tensor)
from mmapckpt.io import cold_plan, cold_reads, direct_reads, read_choice, staging
from mmapckpt.io.read_choice import CANDIDATES, STREAM, Strategy

B4, D8 = Strategy("buffered", 4), Strategy("direct", 8)
WAYS = {"stream": STREAM, "buffered-4": B4, "direct-8": D8}
#: Staging buffers smaller than the larger tensors: each is read over several buffers.
BUF = 1 << 20


@pytest.fixture(autouse=True)
def _staged_and_fresh(monkeypatch):
    monkeypatch.delenv("MMAPCKPT_COLD_READS", raising=False)
    monkeypatch.setattr(staging, "STAGE_CPU_TARGETS", True)
    monkeypatch.setattr(read_choice, "cache_room", lambda: 0)  # reads larger than the page cache: O_DIRECT tried too
    read_choice.forget()
    yield
    read_choice.forget()


class Spy:
    """What io/cold_reads.py was asked to do: each read_pieces call (way, bytes), the buffered and O_DIRECT
    runs it started (thread, bytes), and the O_DIRECT opens tried."""

    def __init__(self, monkeypatch) -> None:
        self.calls: list[tuple[Strategy, int]] = []
        self.runs: list[tuple[str, int, str]] = []
        self.direct_opens = 0
        self._mutex = threading.Lock()
        real_pieces, real_buffered, real_direct, real_open = (cold_plan.read_pieces, cold_reads._buffered_run,
                                                              cold_reads._direct_run, cold_reads._open_direct)

        def pieces(fd, path, ident, part, strategy, **kw):
            self.calls.append((strategy, sum(cold_reads.nbytes(p.buf) for p in part)))
            return real_pieces(fd, path, ident, part, strategy, **kw)

        def buffered(fd, path, ident, run):
            self.runs.append(("buffered", sum(cold_reads.nbytes(p.buf) for p in run), threading.current_thread().name))
            return real_buffered(fd, path, ident, run)

        def direct(dfd, run, path):
            self.runs.append(("direct", sum(b[1] for b in run), threading.current_thread().name))
            return real_direct(dfd, run, path)

        def open_direct(path, ident):
            with self._mutex:  # reader threads may open at once: `+=` alone could lose a count
                self.direct_opens += 1
            return real_open(path, ident)

        monkeypatch.setattr(cold_plan, "read_pieces", pieces)
        monkeypatch.setattr(cold_reads, "_buffered_run", buffered)
        monkeypatch.setattr(cold_reads, "_direct_run", direct)
        monkeypatch.setattr(cold_reads, "_open_direct", open_direct)

    def bytes_by(self, way: Strategy) -> int:
        return sum(n for s, n in self.calls if s == way)


def _state_dict() -> dict[str, torch.Tensor]:
    return {"big": seeded_tensor("big", (700, 1000), torch.float32),  # 2.8 MB: several buffers
            "bf": seeded_tensor("bf", (1000, 513), torch.bfloat16),
            "f8": seeded_tensor("f8", (40_000,), torch.float8_e4m3fn),
            "tiny": torch.tensor([-0.0]), "nan": seeded_tensor("nan", (2,), torch.float64),
            "i64": torch.arange(300_000, dtype=torch.int64)}


def _evict(directory) -> None:
    for name in os.listdir(directory):
        fd = os.open(os.path.join(directory, name), os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


@pytest.fixture
def cold(monkeypatch):
    """Evict a checkpoint's files; the cache probe answers cold (reading the header may bring a first page
    back, and a tmpfs keeps every page)."""
    monkeypatch.setattr(direct_reads, "is_cached", lambda fd, offsets: False)
    return _evict


def _load_into(sd, path, buf: int = BUF) -> dict[str, torch.Tensor]:
    out = {k: torch.full_like(v, 3) for k, v in sd.items()}
    mmapckpt.load_into(out, path, staging_bytes=buf)
    return out


def _dcp(sd, path, buf: int = BUF) -> dict[str, torch.Tensor]:
    reader = mmapckpt.MmapReader(path, staging_bytes=buf)
    reader._stage_cpu_targets = True  # the accelerator path for CPU targets (tests/dcp/test_staged_loads.py)
    return dcp_load({k: torch.full_like(v, 3) for k, v in sd.items()}, reader)


def _save(sd, path, loader) -> None:
    if loader is _load_into:
        mmapckpt.save(sd, path)
    else:
        dcp_save(sd, mmapckpt.MmapWriter(path, sync_files=False))


@pytest.mark.parametrize("loader", [_load_into, _dcp], ids=["load_into", "dcp.load"])
@pytest.mark.parametrize("way", list(WAYS))
def test_a_cold_staged_load_reads_by_the_chosen_way_bitwise(tmp_path, monkeypatch, cold, loader, way):
    sd = _state_dict()
    path = str(tmp_path / "c")
    _save(sd, path, loader)
    cold(path)
    monkeypatch.setenv("MMAPCKPT_COLD_READS", way)
    spy = Spy(monkeypatch)
    assert_tree_equal(loader(sd, path), sd)
    total = sum(v.nbytes for v in sd.values())
    strategy = WAYS[way]
    assert spy.bytes_by(strategy) == total and len(spy.calls) >= 3, spy.calls  # every byte, a buffer at a time
    kinds = {k for k, _, _ in spy.runs}
    if strategy.kind == "stream":
        assert kinds == set() and spy.direct_opens == 0
    elif strategy.kind == "buffered":  # a full buffer is shared by 4 runs, each on a descriptor of its own
        assert kinds == {"buffered"} and spy.direct_opens == 0
        assert sum(n for _, n, _ in spy.runs) == total
        assert len(spy.runs) >= 4 * (total // BUF - 1) and all(t != threading.current_thread().name
                                                              for _, _, t in spy.runs)
    else:  # O_DIRECT blocks cover every byte
        assert kinds == {"direct"} and spy.direct_opens == len(spy.calls)
        assert sum(n for _, n, _ in spy.runs) >= total


@pytest.mark.parametrize("loader", [_load_into, _dcp], ids=["load_into", "dcp.load"])
def test_the_trials_of_a_staged_load_are_timed_across_buffers_and_recorded(tmp_path, monkeypatch, cold, loader):
    """No way fixed: the first large cold read tries each candidate on a slice of the file. A slice here is
    one 300 KB tensor read over five 64 KiB buffers: one sample of its whole bytes per candidate."""
    sd = {f"t{i}": seeded_tensor(f"t{i}", (75_000,), torch.float32) for i in range(8)}
    path = str(tmp_path / "c")
    _save(sd, path, loader)
    cold(path)
    monkeypatch.setattr(read_choice, "TRIAL_BYTES", 256 << 10)
    monkeypatch.setattr(staging, "FILL_THREADS", 2)
    recorded = []
    real_record = read_choice.record
    monkeypatch.setattr(read_choice, "record", lambda dev, s, n, t: recorded.append((s, n)) or real_record(dev, s, n,
                                                                                                            t))
    spy = Spy(monkeypatch)
    assert_tree_equal(loader(sd, path, 64 << 10), sd)
    assert sorted(recorded) == sorted((s, 300_000) for s in CANDIDATES), recorded
    dev = os.stat(path).st_dev
    assert {s: len(v) for s, v in read_choice._samples[dev].items()} == {s: 1 for s in CANDIDATES}
    assert {k for k, _, _ in spy.runs} == {"buffered", "direct"}
    assert spy.bytes_by(STREAM) == 300_000 * 6  # the stream trial and the rest (no choice yet: one stream)


@pytest.mark.parametrize("fixed", [True, False], ids=["direct-8", "trial"])
def test_a_file_that_refuses_o_direct_is_read_as_one_stream_and_marked(tmp_path, monkeypatch, cold, fixed):
    sd = _state_dict()
    path = str(tmp_path / "c")
    mmapckpt.save(sd, path)
    cold(path)
    if fixed:
        monkeypatch.setenv("MMAPCKPT_COLD_READS", "direct-8")
    else:
        monkeypatch.setattr(read_choice, "TRIAL_BYTES", 4096)
    refuse_o_direct(monkeypatch)
    spy = Spy(monkeypatch)
    assert_tree_equal(_load_into(sd, path), sd)
    dev = os.stat(path).st_dev
    assert read_choice._samples[dev][D8] == [0.0] * read_choice.TRIALS
    assert D8 not in [s.strategy for s in read_choice.plan(dev, [(0, 1 << 30)]) if s.trial]
    assert spy.direct_opens == 1  # refused once, then the segment's later buffers go straight to one stream
    assert {k for k, _, _ in spy.runs} == (set() if fixed else {"buffered"})  # the buffered-4 trial
    if fixed:
        assert spy.bytes_by(STREAM) == sum(v.nbytes for v in sd.values())


@pytest.mark.parametrize("way", ["buffered-4", "direct-8"])
@pytest.mark.parametrize("loader", [_load_into, _dcp], ids=["load_into", "dcp.load"])
def test_a_read_error_in_one_of_the_runs_names_the_file_and_entry(tmp_path, monkeypatch, cold, way, loader):
    """The file is cut short after the load opened it, inside its last tensor: the run that reads past the
    end raises TruncatedFileError naming the file and that tensor, while the other runs succeed."""
    sd = {"a": seeded_tensor("a", (300_000,), torch.float32), "b": seeded_tensor("b", (300_000,), torch.float32)}
    path = str(tmp_path / "c")
    _save(sd, path, loader)
    with mmapckpt.open(path) as f:
        chunks = {k: f.metadata(k).chunks[0] for k in sd}
    last = max(sd, key=lambda k: chunks[k].file_offset)
    cut = chunks[last].file_offset + chunks[last].length - 100_000
    cold(path)
    monkeypatch.setenv("MMAPCKPT_COLD_READS", way)
    real_open = direct_reads.DirectReads._open

    def open_then_cut(self, ranges):
        real_open(self, ranges)
        os.truncate(self.file.path, cut)

    monkeypatch.setattr(direct_reads.DirectReads, "_open", open_then_cut)
    spy = Spy(monkeypatch)
    with pytest.raises(BaseException) as info:
        loader(sd, path)
    err = dcp_failure(info.value)  # dcp.load raises a CheckpointException holding it; load_into raises it
    assert isinstance(err, mmapckpt.TruncatedFileError), repr(info.value)
    assert err.path == os.path.join(path, chunks[last].file) and last in str(err.entry), (err.path, err.entry)
    assert len(spy.runs) > 1  # the reads that failed were one of several runs
    assert read_choice._samples == {}


def test_trials_that_completed_are_recorded_when_a_later_read_fails(tmp_path, monkeypatch, cold):
    """As on the CPU path: the trial slices (the first three tensors) were read and timed before the read of
    the last tensor failed; their samples count, the failed read's do not."""
    sd = {f"t{i}": seeded_tensor(f"t{i}", (75_000,), torch.float32) for i in range(8)}
    path = str(tmp_path / "c")
    mmapckpt.save(sd, path)
    with mmapckpt.open(path) as f:
        last = max((f.metadata(k).chunks[0] for k in sd), key=lambda c: c.file_offset)
    cold(path)
    monkeypatch.setattr(read_choice, "TRIAL_BYTES", 256 << 10)
    real_open = direct_reads.DirectReads._open

    def open_then_cut(self, ranges):
        real_open(self, ranges)
        os.truncate(self.file.path, last.file_offset + 1000)

    monkeypatch.setattr(direct_reads.DirectReads, "_open", open_then_cut)
    with pytest.raises(mmapckpt.TruncatedFileError):
        _load_into(sd, path, 64 << 10)
    dev = os.stat(path).st_dev
    assert {s: len(v) for s, v in read_choice._samples[dev].items()} == {s: 1 for s in CANDIDATES}


def test_a_cold_staged_load_into_reads_bitwise_without_spies(tmp_path, cold, monkeypatch):
    """Each way end to end, with every fill thread count the pool may use (1: no parallel shares)."""
    sd = _state_dict()
    path = str(tmp_path / "c")
    mmapckpt.save(sd, path)
    for way in WAYS:
        for threads in (1, 4):
            monkeypatch.setenv("MMAPCKPT_COLD_READS", way)
            monkeypatch.setattr(staging, "FILL_THREADS", threads)
            cold(path)
            out = _load_into(sd, path)
            for k in sd:
                assert_bitwise_equal(out[k], sd[k], f"{way}/{threads}/{k}")


# -- run_fills hands a buffer's fills of one group to it in one call ------------------------------

class _Group:
    def __init__(self) -> None:
        self.calls: list[list[tuple[int, int, int, str | None]]] = []

    def read_many(self, items) -> None:
        self.calls.append([(staged.data_ptr(), off, n, label) for staged, off, n, label in items])
        for staged, off, n, _ in items:
            staged[:n] = torch.arange(off, off + n, dtype=torch.int64).remainder(251).to(torch.uint8)


class _Grouped:
    parallel = False

    def __init__(self, group: _Group, offset: int, label: str) -> None:
        self.group, self.offset, self.label = group, offset, label

    def __call__(self, staged, start, nbytes) -> None:
        raise AssertionError("a grouped reader's fills go to its group")


def test_run_fills_hands_each_groups_fills_to_it_in_one_call_in_buffer_order():
    g1, g2 = _Group(), _Group()
    buf = torch.zeros(1000, dtype=torch.uint8)
    plain_calls = []

    def plain(staged, start, nbytes):
        plain_calls.append((start, nbytes))
        staged[:nbytes] = 7

    a, b, c = _Grouped(g1, 5000, "a"), _Grouped(g2, 100, "b"), _Grouped(g1, 9000, "c")
    fills = [(a, buf[0:100], 40, 100), (b, buf[128:328], 0, 200), (plain, buf[384:400], 3, 16),
             (c, buf[448:948], 0, 500), (a, buf[960:1000], 140, 40)]
    staging.run_fills(fills, 4)
    p = buf.data_ptr()
    assert g1.calls == [[(p, 5040, 100, "a"), (p + 448, 9000, 500, "c"), (p + 960, 5140, 40, "a")]]
    assert g2.calls == [[(p + 128, 100, 200, "b")]] and plain_calls == [(3, 16)]
    assert torch.equal(buf[448:948], torch.arange(9000, 9500).remainder(251).to(torch.uint8))
