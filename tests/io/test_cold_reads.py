"""The cold read ways (io/cold_reads.py) and their choice per device (io/read_choice.py).

The choice is tested on given figures (no timing); the ways are tested for the bytes they
put into their targets, against the file's bytes, for every way.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mmapckpt
from mmapckpt.errors import TruncatedFileError
from mmapckpt.io import cold_reads, direct_reads, read_choice
from mmapckpt.io.read_choice import CANDIDATES, STREAM, Segment, Strategy, choose, parse, segments
from mmapckpt.io.reads import ReadJob, pieces

from helpers import assert_bitwise_equal, refuse_o_direct

WAYS = [STREAM, Strategy("buffered", 1), Strategy("buffered", 3), Strategy("direct", 1), Strategy("direct", 2),
        Strategy("direct", 8)]
B4, D8 = Strategy("buffered", 4), Strategy("direct", 8)


@pytest.fixture(autouse=True)
def _fresh_choices(monkeypatch):
    monkeypatch.delenv("MMAPCKPT_COLD_READS", raising=False)
    # these tests model reads larger than the page cache could hold, where O_DIRECT ways are candidates too
    # (the other case: tests/io/test_read_choice_state.py)
    monkeypatch.setattr(read_choice, "cache_room", lambda: 0)
    read_choice.forget()
    yield
    read_choice.forget()


# -- the choice, on given figures ---------------------------------------------------------------

def test_one_stream_where_parallel_reads_lose():
    # the development VM: two threads on one cold file at 0.65 of one stream
    assert choose({STREAM: [1.0, 1.1, 0.9], B4: [0.65, 0.6, 0.7], D8: [0.9, 0.95, 1.0]}) == STREAM


def test_a_parallel_way_that_wins_by_the_margin():
    assert choose({STREAM: [1.0, 1.0, 1.0], B4: [1.2, 1.3, 1.25], D8: [1.5, 1.6, 0.2]}) == D8
    assert choose({STREAM: [1.0, 1.0, 1.0], B4: [1.3, 1.2, 1.25], D8: [1.0, 1.05, 1.08]}) == B4


def test_a_win_inside_the_margin_keeps_one_stream():
    assert choose({STREAM: [1.0, 1.0, 1.0], D8: [1.05, 1.09, 1.08]}) == STREAM
    assert choose({STREAM: [1.0], D8: [1.05]}, margin=1.0) == D8


def test_no_figures_for_one_stream_means_one_stream():
    assert choose({}) == STREAM
    assert choose({D8: [9.0, 9.0, 9.0]}) == STREAM


def test_parse_names():
    assert parse("stream") == STREAM
    assert parse("direct-8") == D8 and D8.name == "direct-8"
    assert parse("buffered-4") == B4
    for bad in ("direct", "direct-0", "mapped-2", "stream-2", ""):
        with pytest.raises(ValueError):
            parse(bad)


def test_segments_split_between_ranges():
    ranges = [(i * 100, 90) for i in range(10)]
    segs = segments(ranges, [STREAM, B4], D8, trial_bytes=200)
    assert segs == [Segment(STREAM, 0, 300, True), Segment(B4, 300, 600, True), Segment(D8, 600, 1 << 63, False)]
    # every range falls in exactly one segment
    for o, _ in ranges:
        assert sum(s.lo <= o < s.hi for s in segs) == 1


def test_segments_with_fewer_ranges_than_trials_and_none():
    segs = segments([(0, 10)], [STREAM, B4, D8], D8, trial_bytes=100)
    assert segs == [Segment(STREAM, 0, 1 << 63, True)]
    assert segments([], [STREAM], D8) == [Segment(D8, 0, 1 << 63, False)]
    assert segments([(0, 5), (8, 5)], [], B4) == [Segment(B4, 0, 1 << 63, False)]


def _big(n_ranges: int = 64) -> list[tuple[int, int]]:
    size = 2 * len(CANDIDATES) * read_choice.TRIAL_BYTES // n_ranges + 1
    return [(i * size, size) for i in range(n_ranges)]


def test_plan_trials_each_candidate_then_uses_the_choice():
    dev = 12345
    first = read_choice.plan(dev, _big())
    assert [s.strategy for s in first if s.trial] == list(CANDIDATES) and first[-1] == Segment(STREAM, first[-1].lo,
                                                                                               1 << 63, False)
    assert all(not s.trial for s in read_choice.plan(dev, [(0, 4096)]))  # short reads are not trials
    for _ in range(read_choice.TRIALS):
        for s, rate in ((STREAM, 1.0), (B4, 0.7), (D8, 2.0)):
            read_choice.record(dev, s, int(rate * 1e9), 1.0)
    # fitted: one stream below PARALLEL_BYTES (512 MiB), then a stream per TRIAL_BYTES (64 MiB) at most
    assert read_choice.plan(dev, _big()) == [Segment(STREAM, 0, 1 << 63, False)]  # 384 MiB
    assert read_choice.plan(dev, _big(n_ranges=16) * 2) == [Segment(D8, 0, 1 << 63, False)]  # 768 MiB: all 8
    assert read_choice.fitted(D8, 576 << 20) == Strategy("direct", 8)
    assert read_choice.plan(99, _big())[0].trial  # another device measures for itself


def test_one_stream_below_parallel_bytes_and_at_most_a_stream_per_trial_bytes_above(monkeypatch):
    """A cold read shorter than PARALLEL_BYTES is read by one stream (below 256 MiB, where no trials are made either,
    without reading the device's kept samples); a longer one by at most a stream per TRIAL_BYTES."""
    mib = 1 << 20
    assert read_choice.fitted(B4, 1 << 30) == B4
    assert read_choice.fitted(Strategy("direct", 16), 800 * mib) == Strategy("direct", 12)
    assert read_choice.fitted(B4, 512 * mib) == B4
    assert read_choice.fitted(B4, 511 * mib) == STREAM
    assert read_choice.fitted(STREAM, 1) == STREAM
    dev = 4321
    for _ in range(read_choice.TRIALS):
        for s, rate in ((STREAM, 1.0), (B4, 3.0), (D8, 0.5)):
            read_choice.record(dev, s, int(rate * 1e9), 1.0)
    assert read_choice.plan(dev, [(0, 800 * mib)]) == [Segment(B4, 0, 1 << 63, False)]
    assert read_choice.plan(dev, [(0, 300 * mib)]) == [Segment(STREAM, 0, 1 << 63, False)]
    looked = []
    monkeypatch.setattr(read_choice, "_load", lambda device: looked.append(device))
    assert read_choice.plan(dev, [(0, 120 * mib), (130 * mib, 120 * mib)]) == [Segment(STREAM, 0, 1 << 63, False)]
    assert looked == []


def test_plan_tries_again_every_retry_reads_and_follows_the_newest_samples():
    dev = 7
    for _ in range(read_choice.TRIALS):
        for s, rate in ((STREAM, 1.0), (B4, 0.7), (D8, 2.0)):
            read_choice.record(dev, s, int(rate * 1e9), 1.0)
    plans = [read_choice.plan(dev, _big()) for _ in range(read_choice.RETRY)]
    assert all(not any(s.trial for s in p) for p in plans[:-1])
    assert [s.strategy for s in plans[-1] if s.trial] == list(CANDIDATES)
    for _ in range(read_choice.KEEP):  # the disk changed: parallel reads now lose
        for s, rate in ((STREAM, 1.0), (B4, 0.7), (D8, 0.5)):
            read_choice.record(dev, s, int(rate * 1e9), 1.0)
    assert read_choice.plan(dev, _big())[-1].strategy == STREAM


def test_a_refused_way_is_never_chosen_nor_tried_again():
    dev = 8
    read_choice.unsupported(dev, D8)
    assert D8 not in [s.strategy for s in read_choice.plan(dev, _big()) if s.trial]
    for _ in range(read_choice.TRIALS):
        read_choice.record(dev, STREAM, 10**9, 1.0)
        read_choice.record(dev, B4, 10**8, 1.0)
    assert read_choice.plan(dev, _big())[-1].strategy == STREAM


def test_the_environment_fixes_the_way(monkeypatch):
    monkeypatch.setenv("MMAPCKPT_COLD_READS", "buffered-2")
    assert read_choice.plan(1, _big()) == [Segment(Strategy("buffered", 2), 0, 1 << 63, False)]


# -- the ways, bitwise ----------------------------------------------------------------------------

def _file(tmp_path, data: bytes) -> tuple[str, int, tuple[int, int]]:
    path = str(tmp_path / "f.bin")
    with open(path, "wb") as f:
        f.write(data)
    fd = os.open(path, os.O_RDONLY)
    st_ = os.fstat(fd)
    return path, fd, (st_.st_dev, st_.st_ino)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(size=st.integers(1, 3 * 4096 * 1024 + 777), data=st.data())
def test_every_way_reads_the_file_bytes(tmp_path, size, data):
    content = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    path, fd, ident = _file(tmp_path, content)
    try:
        cuts = sorted(data.draw(st.lists(st.integers(0, size), max_size=12)))
        bounds = [0] + cuts + [size]
        regions = [(a, b - a) for a, b in zip(bounds, bounds[1:]) if data.draw(st.booleans())]  # gaps, tiny, tails
        for way in WAYS:
            jobs = []
            for off, n in regions:
                arr = np.full(n, 0xAB, np.uint8)
                buf = memoryview(arr) if n % 2 else arr  # both kinds of buffer the readers hand out
                jobs.append((ReadJob(buf, off, f"e{off}"), arr))
            assert cold_reads.read_pieces(fd, path, ident, pieces([j for j, _ in jobs]), way)
            for (j, arr) in jobs:
                assert arr.tobytes() == content[j.offset:j.offset + arr.size], (way, j.offset, arr.size)
    finally:
        os.close(fd)


MiB = 1 << 20


@pytest.mark.parametrize("way", WAYS, ids=lambda w: w.name)
def test_pieces_across_block_boundaries_misaligned_and_at_the_tail(tmp_path, way):
    """Hypothesis mostly draws small files; these cross the 4 MiB O_DIRECT blocks on purpose."""
    size = 9 * MiB + 123  # a tail that is not a whole block
    content = np.random.default_rng(9).integers(0, 256, size, dtype=np.uint8).tobytes()
    path, fd, ident = _file(tmp_path, content)
    regions = [[(0, size)], [(4 * MiB - 5, 10), (4 * MiB + 7, 3 * MiB), (8 * MiB + 1, size - 8 * MiB - 1)],
               [(100, 4 * MiB), (5, 1), (4 * MiB + 200, 0), (size - 1, 1)], [(3 * MiB, 2 * MiB + 1)],
               [(i * 3 * MiB + 11, 2 * MiB) for i in range(3)]]  # gaps longer than GAP
    try:
        for rs in regions:
            jobs = [(ReadJob(np.full(n, 0xAB, np.uint8), o, "e"), o, n) for o, n in rs if n]
            assert cold_reads.read_pieces(fd, path, ident, pieces([j for j, _, _ in jobs]), way)
            for j, o, n in jobs:
                assert np.asarray(j.buf).tobytes() == content[o:o + n], (way, o, n)
    finally:
        os.close(fd)


@pytest.mark.parametrize("way", WAYS, ids=lambda w: w.name)
def test_a_file_shorter_than_a_piece_raises(tmp_path, way):
    path, fd, ident = _file(tmp_path, b"x" * 10000)
    try:
        with open(path, "r+b") as f:
            f.truncate(5000)  # shrank after it was opened
        with pytest.raises(TruncatedFileError):
            cold_reads.read_pieces(fd, path, ident, [ReadJob(np.zeros(8000, np.uint8), 0, "t")], way)
    finally:
        os.close(fd)


def _takes_o_direct(path: str) -> bool:
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_DIRECT))
    except (AttributeError, OSError):
        return False
    return True


@pytest.mark.parametrize("then", ["replaced", "removed"])
@pytest.mark.parametrize("way", WAYS, ids=lambda w: w.name)
def test_a_file_changed_at_its_path_is_read_from_the_open_one(tmp_path, way, then):
    """Every way reads the file that was opened (its descriptor, opened again through /proc/self/fd where a way
    needs a description of its own), never the path: O_DIRECT ways too, where the file system takes O_DIRECT."""
    path, fd, ident = _file(tmp_path, b"A" * 20000)
    direct_ok = _takes_o_direct(path)
    try:
        if then == "replaced":
            tmp = path + ".new"
            with open(tmp, "wb") as f:
                f.write(b"B" * 20000)
            os.replace(tmp, path)
        else:
            os.unlink(path)
        out = np.zeros(12345, np.uint8)
        ok = cold_reads.read_pieces(fd, path, ident, [ReadJob(out, 100, "t")], way)
        assert ok or (way.kind == "direct" and not direct_ok), "the way was given up: the path was opened again"
        if not ok:  # a file system without O_DIRECT: the caller reads the open one as a stream
            assert cold_reads.read_pieces(fd, path, ident, [ReadJob(out, 100, "t")], STREAM)
        assert out.tobytes() == b"A" * 12345
    finally:
        os.close(fd)


# -- through load_into, cold ----------------------------------------------------------------------

def _state_dict() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    sd = {f"t{i}": torch.randn(n, generator=g).to(torch.bfloat16) for i, n in enumerate([1, 3, 1000, 4097, 70000, 7])}
    sd["empty"] = torch.empty(0, 5, dtype=torch.bfloat16)
    sd["nan"] = torch.tensor([float("nan"), -0.0, 1.0]).to(torch.bfloat16).view(torch.int16).bitwise_or(1).view(
        torch.bfloat16)
    sd["f32"] = torch.randn(333, 77, generator=g)
    return sd


@pytest.mark.parametrize("way", ["stream", "buffered-3", "direct-1", "direct-8", "auto"])
def test_load_into_cold_by_each_way_is_bitwise(tmp_path, monkeypatch, way):
    sd = _state_dict()
    mmapckpt.save(sd, str(tmp_path / "ck"))
    if way != "auto":
        monkeypatch.setenv("MMAPCKPT_COLD_READS", way)
    else:  # trials on a small read: shrink the trial slices so that every candidate gets one
        monkeypatch.setattr(read_choice, "TRIAL_BYTES", 4096)
    monkeypatch.setattr(direct_reads, "is_cached", lambda fd, offsets: False)  # cold, also on a tmpfs
    targets = {k: torch.full_like(v, 3) for k, v in sd.items()}
    mmapckpt.load_into(targets, str(tmp_path / "ck"))
    for k in sd:
        assert_bitwise_equal(targets[k], sd[k], k)
    if way == "auto":
        samples = read_choice._samples[os.stat(tmp_path).st_dev]
        assert set(samples) == set(CANDIDATES)


@pytest.mark.parametrize("way, advice", [("stream", set()), ("buffered-3", {os.POSIX_FADV_SEQUENTIAL})])
def test_one_stream_reads_with_the_kernels_own_readahead(tmp_path, monkeypatch, way, advice):
    """One stream gives the kernel no advice (SEQUENTIAL and WILLNEED each made it slower: io/cold_reads.py);
    each stream of ``buffered-N`` asks for sequential readahead on its own open file."""
    sd = _state_dict()
    mmapckpt.save(sd, str(tmp_path / "ck"))
    monkeypatch.setenv("MMAPCKPT_COLD_READS", way)
    monkeypatch.setattr(direct_reads, "is_cached", lambda fd, offsets: False)
    given: list[int] = []
    real = os.posix_fadvise
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, off, n, how: (given.append(how), real(fd, off, n, how))[1])
    targets = {k: torch.full_like(v, 3) for k, v in sd.items()}
    mmapckpt.load_into(targets, str(tmp_path / "ck"))
    for k in sd:
        assert_bitwise_equal(targets[k], sd[k], k)
    assert set(given) == advice


def test_load_into_where_o_direct_is_refused_reads_one_stream(tmp_path, monkeypatch):
    sd = _state_dict()
    mmapckpt.save(sd, str(tmp_path / "ck"))
    refuse_o_direct(monkeypatch)
    monkeypatch.setattr(read_choice, "TRIAL_BYTES", 4096)
    monkeypatch.setattr(direct_reads, "is_cached", lambda fd, offsets: False)
    targets = {k: torch.full_like(v, 3) for k, v in sd.items()}
    mmapckpt.load_into(targets, str(tmp_path / "ck"))
    for k in sd:
        assert_bitwise_equal(targets[k], sd[k], k)
    dev = os.stat(tmp_path).st_dev
    assert read_choice._samples[dev][D8] == [0.0] * read_choice.TRIALS
    assert read_choice.plan(dev, _big())[-1].strategy != D8
