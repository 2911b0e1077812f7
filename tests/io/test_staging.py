"""The staging pool's logic on the CPU: block planning and buffer rotation.

The CUDA specifics (pinned buffers, side stream, events) run only in
tests/gpu/test_cuda_load.py; here the same loop (the caller packing buffers, the pool's
filler thread filling them and copying out of them) runs into CPU destinations, with
buffers small enough to force many blocks and reuse.
"""

from __future__ import annotations

import gc
import math
import os
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import helpers
import mmapckpt
import lazy_dist
from mmapckpt.io.staging import StagingPool, plan_blocks

shapes = st.lists(st.integers(0, 6), min_size=0, max_size=4).map(tuple)


@settings(max_examples=200, deadline=None)
@given(shape=shapes, itemsize=st.sampled_from([1, 2, 4, 8, 16]), cap_items=st.integers(1, 40))
def test_blocks_tile_the_tensor_in_byte_order(shape, itemsize, cap_items):
    cap = cap_items * itemsize + (cap_items % 3)  # caps that are not a multiple of the item size too
    numel = math.prod(shape)
    ref = torch.arange(numel).reshape(shape)
    pos = 0
    for b in plan_blocks(shape, itemsize, cap):
        assert b.start == pos and 0 < b.nbytes <= cap and b.nbytes % itemsize == 0
        elems = ref[b.index].reshape(-1)
        assert torch.equal(elems, torch.arange(b.start // itemsize, (b.start + b.nbytes) // itemsize))
        pos += b.nbytes
    assert pos == numel * itemsize


def test_blocks_are_big_when_rows_fit():
    blocks = list(plan_blocks((100, 10), 4, 1000))  # 40-byte rows, 25 rows a block
    assert [b.nbytes for b in blocks] == [1000] * 4
    with pytest.raises(ValueError):
        list(plan_blocks((3,), 8, 7))


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16", "float8_e4m3fn", "bool", "complex128", "int64"])
@pytest.mark.parametrize("buffer_bytes, num_buffers", [(16, 1), (24, 2), (40, 3), (1 << 20, 2)])
def test_pool_copies_into_strided_regions(dtype_name, buffer_bytes, num_buffers):
    src = lazy_dist.full_tensor(dtype_name, (7, 3, 5), 11)
    big = torch.zeros((9, 4, 11), dtype=src.dtype)
    region = big[1:8, 1:4, ::2][:, :, :5]  # a non-contiguous destination, like a chunk's place in a tensor
    assert not region.is_contiguous()
    with StagingPool("cpu", staging_bytes=buffer_bytes, staging_buffers=num_buffers) as pool:
        pool.copy(src, region)
    helpers.assert_bitwise_equal(region, src)
    untouched = big.clone()
    untouched[1:8, 1:4, ::2][:, :, :5] = 0
    assert not untouched.view(torch.uint8).any()  # nothing outside the region was written
    n = len(list(plan_blocks(tuple(src.shape), src.element_size(), buffer_bytes)))
    assert sum(pool.blocks_per_buffer) == n
    assert max(pool.blocks_per_buffer) - min(pool.blocks_per_buffer) <= 1  # round robin


def test_pool_handles_scalars_empty_and_odd_strides():
    with StagingPool("cpu", staging_bytes=8, staging_buffers=2) as pool:
        scalar, out = torch.tensor(3.5, dtype=torch.float64), torch.zeros((), dtype=torch.float64)
        pool.copy(scalar, out)
        empty = torch.empty(0, 4)
        pool.copy(empty, torch.empty(0, 4))
        odd = torch.arange(10, dtype=torch.bfloat16)[4:5:4]  # contiguous, yet stride 4 on its size-1 dim
        dst = torch.zeros(1, dtype=torch.bfloat16)
        pool.copy(odd, dst)
    assert out.item() == 3.5 and dst.item() == 4.0
    with pytest.raises(ValueError):
        StagingPool("cpu").copy(torch.zeros(3), torch.zeros(4))
    with pytest.raises(ValueError):
        StagingPool("cpu", staging_buffers=0)


# --------------------------------------------------------------------------- the pipeline's properties
#: sizes in units of the buffer: 0 bytes, 1 byte, exactly a buffer, 3.5 buffers, and odd ones
_SIZES = st.sampled_from(["zero", "byte", "buffer", "3.5", "small", "odd"])
_DTYPES = st.sampled_from([torch.uint8, torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.int64,
                           torch.complex64, torch.bool])


def _numel(kind: str, buf: int, itemsize: int, odd: int) -> int:
    return {"zero": 0, "byte": 1, "buffer": buf // itemsize, "3.5": (7 * buf // 2) // itemsize,
            "small": 1 + odd % 7, "odd": odd}[kind]


@settings(max_examples=120, deadline=None)
@given(items=st.lists(st.tuples(_SIZES, _DTYPES, st.integers(0, 300), st.booleans()), min_size=1, max_size=12),
       buf_kib=st.sampled_from([1, 4]), buffers=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_any_mix_lands_bitwise_within_the_bounded_ring(items, buf_kib, buffers, seed):
    """0 bytes, 1 byte, exactly a buffer, 3.5 buffers, strided sources: bitwise, at most `buffers` in use,
    each `done` exactly once and only once its destination is complete."""
    g = torch.Generator().manual_seed(seed)
    cap = buf_kib << 10
    pool = StagingPool("cpu", staging_bytes=cap, staging_buffers=buffers)
    pairs, calls = [], []
    with pool:
        for k, (kind, dtype, odd, strided) in enumerate(items):
            n = _numel(kind, cap, dtype.itemsize, odd)
            raw = torch.randint(0, 256, (2 * n * dtype.itemsize,), dtype=torch.uint8, generator=g)
            whole = raw.view(dtype)  # NaN payloads and -0.0 included: raw bytes
            src = whole[::2] if strided else whole[:n]  # a strided source, as a resharded region is
            dst = torch.zeros(n, dtype=dtype)

            def done(k=k, src=src, dst=dst):
                assert helpers.tensor_bytes(dst) == helpers.tensor_bytes(src), f"item {k} committed incomplete"
                calls.append(k)

            pool.copy(src, dst, done=done)
            pairs.append((src, dst))
    assert sorted(calls) == list(range(len(items)))
    assert pool.max_in_use <= buffers
    for src, dst in pairs:
        helpers.assert_bitwise_equal(dst, src)


def test_small_tensors_share_a_buffer_and_large_ones_stream_in_pieces():
    pool = StagingPool("cpu", staging_bytes=4096, staging_buffers=3)
    with pool:
        for i in range(40):  # 40 x 64 bytes: one buffer
            pool.copy(torch.full((16,), float(i)), torch.empty(16))
    assert pool.blocks_per_buffer == [40, 0, 0]
    pool = StagingPool("cpu", staging_bytes=4096, staging_buffers=2)
    src = torch.arange(3500, dtype=torch.float32)  # 14,000 bytes: four pieces through two buffers
    dst = torch.empty_like(src)
    with pool:
        pool.copy(src, dst)
    assert pool.blocks_per_buffer == [2, 2] and pool.max_in_use == 2
    assert torch.equal(dst, src)


def test_callbacks_wait_until_the_buffer_is_reused_or_flushed():
    """`done` runs when the buffer holding the item's last block is waited for, not when it is filled."""
    pool = StagingPool("cpu", staging_bytes=1024, staging_buffers=2)
    seen: list[str] = []
    with pool:
        pool.copy(torch.zeros(200), torch.empty(200), done=lambda: seen.append("a"))  # 800 B: buffer 0
        assert seen == []
        pool.copy(torch.zeros(200), torch.empty(200), done=lambda: seen.append("b"))  # buffer 1
        assert seen == []
        pool.copy(torch.zeros(200), torch.empty(200), done=lambda: seen.append("c"))  # reuses buffer 0
        assert seen == ["a"]
    assert seen == ["a", "b", "c"]


def test_an_error_skips_the_callbacks_but_waits_for_the_copies():
    pool = StagingPool("cpu", staging_bytes=1024, staging_buffers=2)
    seen: list[int] = []
    with pytest.raises(RuntimeError):
        with pool:
            pool.copy(torch.zeros(8), torch.empty(8), done=lambda: seen.append(1))
            raise RuntimeError("a read failed")
    assert seen == [] and pool._ring.order == []  # nothing committed, nothing left in flight
    pool.close()
    with pytest.raises(ValueError, match="closed"):
        pool.copy(torch.zeros(1), torch.empty(1))


def test_reads_fill_the_buffers_from_the_file(tmp_path):
    """With `read`, the bytes come from the file at the source's place, piece by piece, not from the source."""
    from mmapckpt.io.direct_reads import DirectReads
    from mmapckpt.io.mapped import MappedFile

    data = torch.arange(5000, dtype=torch.int32)
    path = tmp_path / "f"
    path.write_bytes(b"\0" * 4096 + data.numpy().tobytes())
    fd = os.open(path, os.O_RDONLY)
    try:
        mapped = MappedFile(fd, str(path))
    finally:
        os.close(fd)
    src = mapped.view(4096, torch.int32, (5000,))
    reads = DirectReads(mapped, ranges=[(4096, 20000)])
    calls: list[tuple[int, int]] = []
    inner = reads.reader_for(src, "x")

    def read(staged, start, nbytes):
        calls.append((start, nbytes))
        inner(staged, start, nbytes)

    dst = torch.zeros(5000, dtype=torch.int32)
    try:
        with StagingPool("cpu", staging_bytes=8192, staging_buffers=2) as pool:
            pool.copy(src, dst, read=read)
    finally:
        reads.close()
    assert calls == [(0, 8192), (8192, 8192), (16384, 3616)]
    assert torch.equal(dst, data)
    assert reads.reader_for(src[::2]) is None  # a strided region is gathered from the mapping instead


class _Recorder:
    """A staging reader over ``data`` that notes which thread read which range."""

    def __init__(self, data: torch.Tensor, parallel: bool) -> None:
        self.data, self.parallel, self.calls = data, parallel, []

    def __call__(self, staged: torch.Tensor, start: int, nbytes: int) -> None:
        self.calls.append((threading.current_thread().name, start, nbytes))
        staged.copy_(self.data[start:start + nbytes])


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.integers(0, 40_000), min_size=1, max_size=6), threads=st.integers(1, 5),
       piece=st.sampled_from([1000, 4096, 50_000]), parallel=st.lists(st.booleans(), min_size=6, max_size=6))
def test_a_buffers_reads_are_shared_by_threads_and_land_bitwise(sizes, threads, piece, parallel):
    """The reads of a buffer run when the host leaves it: those of ``parallel`` readers are cut into about
    equal shares for several threads, the others run whole on the pool's filler thread; every byte lands at its
    place, each range is read exactly once, and the copies see the filled buffer."""
    import unittest.mock

    from mmapckpt.io import staging

    srcs = [torch.randint(0, 256, (n,), dtype=torch.uint8) for n in sizes]
    readers = [_Recorder(s, p) for s, p in zip(srcs, parallel)]
    dsts = [torch.zeros_like(s) for s in srcs]
    with unittest.mock.patch.object(staging, "FILL_THREADS", threads), \
            unittest.mock.patch.object(staging, "_FILL_PIECE", piece):
        with StagingPool("cpu", staging_bytes=64_000, staging_buffers=2) as pool:
            for s, d, r in zip(srcs, dsts, readers):
                pool.copy(torch.empty_like(s), d, read=r)  # the source's own bytes are never used
    for s, d, r in zip(srcs, dsts, readers):
        assert torch.equal(d, s)
        covered = sorted((a, a + n) for _, a, n in r.calls)
        assert sum(n for _, _, n in r.calls) == s.numel()  # every byte read once
        at = 0
        for a, b in covered:
            assert a == at
            at = b
        if not r.parallel:  # whole, on the pool's filler thread
            assert all(name.startswith("mmapckpt-stage") for name, _, _ in r.calls), r.calls


def test_reads_are_shared_out_only_for_a_parallel_reader_and_large_fills(monkeypatch):
    from mmapckpt.io import staging

    monkeypatch.setattr(staging, "FILL_THREADS", 4)
    monkeypatch.setattr(staging, "_FILL_PIECE", 4096)
    data = torch.randint(0, 256, (60_000,), dtype=torch.uint8)
    for parallel in (True, False):
        r = _Recorder(data, parallel)
        out = torch.zeros_like(data)
        with StagingPool("cpu", staging_bytes=64_000, staging_buffers=2) as pool:
            pool.copy(torch.empty_like(data), out, read=r)
        assert torch.equal(out, data)
        names = {n for n, _, _ in r.calls}
        assert len(r.calls) == (4 if parallel else 1) and (len(names) > 1) == parallel, r.calls


def test_a_staged_load_reads_before_its_files_close(tmp_path, monkeypatch):
    """The reads run late (when the host leaves a buffer), so each file's pending reads must run before its
    descriptor closes: load_into and dcp.load through the pool (CPU targets), with one buffer larger than
    the whole checkpoint, so that nothing is read until the end of the load."""
    import torch.distributed.checkpoint as dcp

    from mmapckpt.io import staging

    monkeypatch.setattr(staging, "STAGE_CPU_TARGETS", True)
    sd = {f"t{i}": torch.randn(1000 + i) for i in range(5)}
    mmapckpt.save(sd, tmp_path / "a")
    dcp.save(sd, storage_writer=mmapckpt.MmapWriter(tmp_path / "b"), no_dist=True)
    big = 1 << 20
    out = {k: torch.zeros_like(v) for k, v in sd.items()}
    mmapckpt.load_into(out, tmp_path / "a", staging_bytes=big)
    helpers.assert_tree_equal(out, sd)
    out = {k: torch.zeros_like(v) for k, v in sd.items()}
    reader = mmapckpt.MmapReader(tmp_path / "b", staging_bytes=big)
    reader._stage_cpu_targets = True
    dcp.load(out, storage_reader=reader, no_dist=True)
    helpers.assert_tree_equal(out, sd)


def test_deprecated_names_still_work_and_warn():
    from mmapckpt.io.staging import staging_options

    with pytest.warns(DeprecationWarning, match="buffer_bytes is deprecated; use staging_bytes"):
        assert staging_options(None, None, 4096, None, "x") == (4096, 3)
    assert staging_options(1024, 2, None, None, "x") == (1024, 2)


class _Gate:
    """A staging reader that blocks, on its first call, until released (or 10 s pass: then it notes a timeout)."""

    def __init__(self, data: torch.Tensor) -> None:
        self.data, self.entered, self.release, self.timed_out = data, threading.Event(), threading.Event(), False
        self.parallel = False

    def __call__(self, staged: torch.Tensor, start: int, nbytes: int) -> None:
        self.entered.set()
        if not self.release.wait(10):
            self.timed_out = True
        staged.copy_(self.data[start:start + nbytes])


def test_the_caller_packs_the_next_buffer_while_the_last_one_fills():
    """The fills of a buffer run on the pool's filler thread: the caller goes on to the next buffer meanwhile.
    Here the first buffer's read cannot finish until the caller has packed the second one (with fills on the
    caller's thread, it would wait out its 10 s and note the timeout)."""
    a, b = torch.arange(200, dtype=torch.float32), torch.arange(200, 400, dtype=torch.float32)
    gate = _Gate(a.view(torch.uint8))
    out_a, out_b = torch.zeros_like(a), torch.zeros_like(b)
    with StagingPool("cpu", staging_bytes=1024, staging_buffers=2) as pool:
        pool.copy(torch.empty_like(a), out_a, read=gate)  # 800 bytes: buffer 0
        pool.copy(b, out_b)  # does not fit: buffer 0 goes to the filler, b is packed into buffer 1
        gate.release.set()
    assert not gate.timed_out
    assert torch.equal(out_a, a) and torch.equal(out_b, b)
    assert pool.stats["buffers"] == 2


def test_a_buffer_is_not_packed_again_before_its_fill_and_copies_are_done():
    """Two buffers: the third item needs buffer 0 again, so the caller waits for buffer 0's (blocked) fill; it
    gets it back only once that fill has run and its copies are out, and every byte lands."""
    srcs = [torch.full((200,), float(i)) for i in range(3)]
    outs = [torch.zeros(200) for _ in srcs]
    gate = _Gate(srcs[0].view(torch.uint8))
    pool = StagingPool("cpu", staging_bytes=1024, staging_buffers=2)
    returned: list[int] = []

    def caller() -> None:
        with pool:
            pool.copy(torch.empty_like(srcs[0]), outs[0], read=gate)
            for i in (1, 2):
                pool.copy(srcs[i], outs[i])
                returned.append(i)

    t = threading.Thread(target=caller)
    t.start()
    try:
        assert gate.entered.wait(10)
        deadline = 100
        while returned != [1] and deadline:  # the second item is packed without waiting for buffer 0
            threading.Event().wait(0.01)
            deadline -= 1
        threading.Event().wait(0.2)
        assert returned == [1], "the third item was packed into buffer 0 while its fill was still running"
    finally:
        gate.release.set()
        t.join(20)
    assert returned == [1, 2] and not gate.timed_out
    for s, o in zip(srcs, outs):
        assert torch.equal(o, s)
    assert pool.stats["wait_s"] > 0 and pool.max_in_use == 2
    pool.close()


def test_a_failed_fill_is_raised_to_the_caller_and_commits_nothing():
    """A read that fails on the filler thread comes out of the load (at the wait for its buffer or at the
    flush), with no callback run; the pool then serves the next load."""
    def broken(staged: torch.Tensor, start: int, nbytes: int) -> None:
        raise OSError(5, "Input/output error", "shard.mmap")

    pool = StagingPool("cpu", staging_bytes=1024, staging_buffers=2)
    seen: list[int] = []
    for n in (1, 5):  # the error found by the flush (one buffer), or by the caller reusing the buffer
        with pytest.raises(OSError, match="Input/output error"):
            with pool:
                pool.copy(torch.empty(200), torch.empty(200), done=lambda: seen.append(0), read=broken)
                for i in range(n):
                    pool.copy(torch.zeros(200), torch.empty(200), done=lambda: seen.append(1))
        assert seen == [] and pool._ring.order == [] and all(s.sealed is None for s in pool._ring.slots)
    src, out = torch.arange(1000.0), torch.zeros(1000)
    with pool:
        pool.copy(src, out, done=lambda: seen.append(2))
    assert torch.equal(out, src) and seen == [2]
    pool.close()


def test_seal_returns_once_no_fill_is_left_and_run_false_drops_them():
    """After seal() no read handed to copy() runs any more (the caller closes its files next); seal(run=False)
    drops the current buffer's reads."""
    data = torch.arange(4096, dtype=torch.uint8)
    calls: list[int] = []

    def read(staged: torch.Tensor, start: int, nbytes: int) -> None:
        threading.Event().wait(0.05)  # a slow disk: the filler is still busy when seal() is called
        calls.append(start)
        staged.copy_(data[start:start + nbytes])

    out = torch.zeros_like(data)
    with StagingPool("cpu", staging_bytes=1024, staging_buffers=4) as pool:
        pool.copy(torch.empty_like(data), out, read=read)
        pool.seal()
        assert sorted(calls) == [0, 1024, 2048, 3072]
    assert torch.equal(out, data)
    calls.clear()
    with pytest.raises(RuntimeError, match="walk failed"):
        with pool:
            pool.copy(torch.empty(512, dtype=torch.uint8), torch.zeros(512, dtype=torch.uint8), read=read)
            pool.seal(run=False)
            raise RuntimeError("walk failed")
    assert calls == []
    pool.close()


def test_a_closing_pool_reports_where_its_time_went(tmp_path, monkeypatch):
    """The benchmark's view of a load: each pool, as it closes, hands its counters to STATS_HOOK."""
    from mmapckpt.io import staging

    reports: list[dict] = []
    monkeypatch.setattr(staging, "STAGE_CPU_TARGETS", True)
    monkeypatch.setattr(staging, "STATS_HOOK", reports.append)
    sd = {f"t{i}": torch.randn(3000) for i in range(4)}
    mmapckpt.save(sd, tmp_path / "c")
    out = {k: torch.zeros_like(v) for k, v in sd.items()}
    mmapckpt.load_into(out, tmp_path / "c", staging_bytes=16384, staging_buffers=2)
    helpers.assert_tree_equal(out, sd)
    assert len(reports) == 1
    r = reports[0]
    assert r["buffers"] == 4 and r["staging_bytes"] == 16384 and r["staging_buffers"] == 2 and r["max_in_use"] == 2
    assert r["fill_s"] > 0 and r["device"] == "cpu"


def _copy_in_child(pool: StagingPool, conn) -> None:
    src, out = torch.arange(5000, dtype=torch.float32), torch.zeros(5000)
    with pool:
        pool.copy(src, out)
    conn.send(bool(torch.equal(out, src)))


def test_a_pool_used_before_a_fork_serves_the_child():
    """The filler thread does not survive a fork: a child using its parent's pool gets a filler of its own
    (with the parent's, whose thread the child lacks, the load would wait for ever)."""
    import multiprocessing

    pool = StagingPool("cpu", staging_bytes=4096, staging_buffers=2)
    with pool:
        pool.copy(torch.ones(3000), torch.zeros(3000))  # the parent's filler thread now runs
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_copy_in_child, args=(pool, child))
    proc.start()
    try:
        assert parent.poll(60), "the child's load did not finish"
        assert parent.recv() is True
        proc.join(30)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join()
    pool.close()


def test_a_failed_read_closes_every_file_of_the_load(tmp_path, monkeypatch):
    """A read that fails on the filler comes out of the first file's close (its seal); every other file of the
    load is still closed, and the error names the file and entry."""
    import torch.distributed.checkpoint as dcp

    from mmapckpt.io import direct_reads, staging

    monkeypatch.setattr(staging, "STAGE_CPU_TARGETS", True)
    sd = {f"t{i}": torch.randn(20_000) for i in range(3)}
    dcp.save(sd, storage_writer=mmapckpt.MmapWriter(tmp_path / "c", single_file_per_rank=False), no_dist=True)
    shards = sorted(p for p in os.listdir(tmp_path / "c") if p.endswith(".distcp"))
    assert len(shards) == 3
    victim = str(tmp_path / "c" / shards[-1])
    real_open = direct_reads.DirectReads._open

    def open_then_cut(self, ranges):
        real_open(self, ranges)
        if self.file.path == victim:
            os.truncate(victim, os.path.getsize(victim) - 40_000)

    monkeypatch.setattr(direct_reads.DirectReads, "_open", open_then_cut)
    gc.collect()  # earlier tests' mappings (each holds a descriptor) go now, not during the count below
    before = len(os.listdir("/proc/self/fd"))
    out = {k: torch.zeros_like(v) for k, v in sd.items()}
    try:
        mmapckpt.load_into(out, tmp_path / "c", staging_bytes=1 << 20)
    except mmapckpt.TruncatedFileError as e:
        path = e.path
    else:
        raise AssertionError("the cut file loaded")
    assert path == victim
    gc.collect()  # the mappings (each holds a descriptor of its own) go with the load's objects
    assert len(os.listdir("/proc/self/fd")) == before  # no descriptor of the load left open
