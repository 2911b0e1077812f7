"""The accelerator staging pipeline (io/staging.py) on a real CUDA device. Skipped without CUDA.

tests/io/test_staging.py and tests/dcp/test_staged_loads.py check the same properties on
the CPU (ordinary buffers, synchronous copies). Here the buffers are pinned, the copies
run non_blocking on a side stream and events guard buffer reuse, so the properties that
only a real device can break are checked: every load bitwise equal to a direct copy and
to the stock reader, no target committed before its copy completed, pinned memory held
to the configured bound and returned on close, and the caller's stream ordered first.
"""

from __future__ import annotations

import gc
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

import helpers
import lazy_dist
import mmapckpt
import strategies
from mmapckpt import MmapReader
from mmapckpt.io.staging import StagingPool

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
warnings.filterwarnings("ignore", message="torch.distributed is disabled")

MIB = 1 << 20
#: sizes in units of the buffer: 0 bytes, 1 byte, exactly a buffer, 3.5 buffers, and odd ones
_SIZES = st.sampled_from(["zero", "byte", "buffer", "3.5", "small", "odd"])
_DTYPES = st.sampled_from([torch.uint8, torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn,
                           torch.float8_e5m2, torch.int64, torch.complex64, torch.bool])


def _numel(kind: str, buf: int, itemsize: int, odd: int) -> int:
    return {"zero": 0, "byte": 1, "buffer": buf // itemsize, "3.5": (7 * buf // 2) // itemsize,
            "small": 1 + odd % 7, "odd": odd}[kind]


def _filled(shape, dtype: torch.dtype, byte: int, device: str = "cuda") -> torch.Tensor:
    """A contiguous tensor on ``device`` whose every byte is ``byte`` (bool: its low bit)."""
    t = torch.empty(shape, dtype=dtype)
    if t.numel():
        t.reshape(-1).view(torch.uint8).fill_(byte & 1 if dtype == torch.bool else byte)
    return t.to(device)


def _to_cuda(tree):
    if isinstance(tree, torch.Tensor):
        return tree.to("cuda")
    if isinstance(tree, dict):
        return {k: _to_cuda(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_to_cuda(v) for v in tree]
    return tree


def _raw(dtype_name: str, shape, seed: int) -> torch.Tensor:
    """Seeded random bytes as the dtype: NaN payloads, -0.0, infinities and subnormals included."""
    return lazy_dist.full_tensor(dtype_name, shape, seed)


def _only_pool(reader: MmapReader) -> StagingPool:
    (pool,) = reader._pools.values()
    return pool


# --------------------------------------------------------------------------- the pool itself
@settings(max_examples=30, deadline=None)
@given(items=st.lists(st.tuples(_SIZES, _DTYPES, st.integers(0, 300), st.booleans()), min_size=1, max_size=10),
       buf_kib=st.sampled_from([1, 4, 64]), buffers=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_any_mix_lands_bitwise_equal_to_a_direct_copy(items, buf_kib, buffers, seed):
    g = torch.Generator().manual_seed(seed)
    cap = buf_kib << 10
    pool = StagingPool("cuda", staging_bytes=cap, staging_buffers=buffers)
    assert all(b.is_pinned() for b in pool.buffers)
    pairs, calls = [], []
    with pool:
        for k, (kind, dtype, odd, strided) in enumerate(items):
            n = _numel(kind, cap, dtype.itemsize, odd)
            raw = torch.randint(0, 256, (2 * n * dtype.itemsize,), dtype=torch.uint8, generator=g)
            if dtype == torch.bool:
                raw &= 1
            whole = raw.view(dtype)  # NaN payloads and -0.0 bytes included: raw bytes
            src = whole[::2] if strided else whole[:n]  # a strided source, as a resharded region is
            dst = _filled((n,), dtype, 0xA5)

            def done(k=k, src=src, dst=dst):
                assert helpers.tensor_bytes(dst) == helpers.tensor_bytes(src), f"item {k} committed incomplete"
                calls.append(k)

            pool.copy(src, dst, done=done)
            pairs.append((src, dst))
    torch.cuda.synchronize()
    assert sorted(calls) == list(range(len(items)))
    assert pool.max_in_use <= buffers
    for src, dst in pairs:
        helpers.assert_bitwise_equal(dst, src.to("cuda"))  # the direct (unstaged) copy
    pool.close()


def test_a_reused_pool_waits_for_its_buffers():
    """Many more blocks than buffers: each refill must wait for the copy out of that buffer."""
    pool = StagingPool("cuda", staging_bytes=MIB, staging_buffers=2)
    srcs = [_raw("float32", (7 * MIB // 8,), i) for i in range(12)]  # 3.5 MiB each
    dsts = [_filled(s.shape, s.dtype, 0) for s in srcs]
    with pool:
        for s, d in zip(srcs, dsts):
            pool.copy(s, d)
    for s, d in zip(srcs, dsts):
        helpers.assert_bitwise_equal(d, s)
    assert pool.max_in_use == 2 and sum(pool.blocks_per_buffer) == 12 * 4
    pool.close()


# --------------------------------------------------------------------------- dcp.load with MmapReader
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(sd=strategies.tensor_state_dicts(), cap=st.sampled_from([64, 256, 4096]), buffers=st.integers(1, 3))
def test_dcp_load_into_cuda_matches_the_stock_reader(tmp_path_factory, sd, cap, buffers):
    path, stock_path = str(tmp_path_factory.mktemp("m")), str(tmp_path_factory.mktemp("s"))
    helpers.dcp_save(sd, mmapckpt.MmapWriter(path, sync_files=False))
    helpers.dcp_save(sd, FileSystemWriter(stock_path))
    reader, planner = MmapReader(path, staging_bytes=cap, staging_buffers=buffers), helpers.checksum_at_commit_planner()

    got = _to_cuda(strategies.fresh_like(sd, 0xA5))
    dcp.load(got, storage_reader=reader, planner=planner, no_dist=True)
    stock = helpers.dcp_load(_to_cuda(strategies.fresh_like(sd, 0x5A)), FileSystemReader(stock_path))
    helpers.assert_tree_equal(got, stock)
    helpers.assert_tree_equal(got, sd)
    flat = strategies.flatten(got)
    assert all(v.device.type == "cuda" for v in flat.values())
    assert planner.seen == {k: helpers.tensor_bytes(v) for k, v in flat.items() if k in planner.seen}
    assert all(pool.max_in_use <= buffers for pool in reader._pools.values())
    # the same reader also reads the stock checkpoint through the pipeline
    helpers.assert_tree_equal(helpers.dcp_load(_to_cuda(strategies.fresh_like(sd, 3)), MmapReader(
        stock_path, staging_bytes=cap, staging_buffers=buffers)), sd)
    reader.close()


def _mixed_state_dict(buf: int) -> dict[str, torch.Tensor]:
    """0 bytes, 1 byte, exactly a buffer, 3.5 buffers; bf16, fp8 (NaN payloads, -0.0) and others."""
    return {
        "zero": torch.empty(0, 5, dtype=torch.bfloat16),
        "byte": _raw("uint8", (1,), 1),
        "buffer": _raw("float32", (buf // 4,), 2),
        "three_and_a_half": _raw("bfloat16", (7 * buf // 4,), 3),
        "fp8": _raw("float8_e4m3fn", (3, buf // 3 + 5), 4),
        "fp8_special": torch.tensor([0x80, 0x7F, 0xFF, 0x00, 0x01], dtype=torch.uint8).view(torch.float8_e4m3fn),
        "neg_zero": torch.tensor([-0.0, 0.0], dtype=torch.bfloat16),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "strided_saved": _raw("float16", (64, 48), 5)[::3, 1::2],
        "bool": _raw("bool", (17,), 6),
    }


def test_commit_tensor_never_sees_an_incomplete_target(tmp_path):
    """Big tensors with small buffers: copies are still in flight when later blocks are filled."""
    sd = {f"w{i}": _raw("float32", (7 * MIB // 8,), i) for i in range(6)} | _mixed_state_dict(MIB)
    helpers.dcp_save(sd, mmapckpt.MmapWriter(tmp_path, sync_files=False))
    reader = MmapReader(tmp_path, staging_bytes=MIB, staging_buffers=2)
    for fill in (0xA5, 0x5A):  # the second load reuses the reader's ring
        planner = helpers.checksum_at_commit_planner()
        got = {k: _filled(v.shape, v.dtype, fill) for k, v in sd.items()}
        dcp.load(got, storage_reader=reader, planner=planner, no_dist=True)
        for k, v in sd.items():
            helpers.assert_bitwise_equal(got[k], v, k)
            if v.numel():  # an empty tensor has nothing to read, so no read item to commit
                assert planner.seen[k] == helpers.tensor_bytes(v), f"{k} committed before its copy completed"
    assert _only_pool(reader).max_in_use <= 2
    reader.close()


def test_the_readers_pool_is_pinned_and_sized(tmp_path):
    sd = _mixed_state_dict(MIB)
    helpers.dcp_save(sd, mmapckpt.MmapWriter(tmp_path, sync_files=False))
    reader = MmapReader(tmp_path, staging_bytes=MIB, staging_buffers=3)
    helpers.dcp_load({k: _filled(v.shape, v.dtype, 0) for k, v in sd.items()}, reader)
    pool = _only_pool(reader)
    assert pool.device.type == "cuda" and all(b.is_pinned() for b in pool.buffers)
    assert [b.numel() for b in pool.buffers] == [MIB] * 3
    reader.close()


# --------------------------------------------------------------------------- load_into and load(device="cuda")
def test_load_into_cuda_targets(tmp_path):
    sd = _mixed_state_dict(4096)
    mmapckpt.save({**sd, "cast": sd["buffer"]}, tmp_path / "c")
    targets = {k: _filled(v.shape, v.dtype, 0xA5) for k, v in sd.items()}
    targets["cast"] = torch.zeros(sd["buffer"].shape, dtype=torch.float64, device="cuda")  # copy_ casts
    base = _filled((sd["bool"].numel(), 3), torch.bool, 0)
    targets["bool"] = base[:, 1]  # a non-contiguous target
    mmapckpt.load_into(targets, tmp_path / "c", staging_bytes=4096, staging_buffers=2)
    for k, v in sd.items():
        assert targets[k].device.type == "cuda"
        helpers.assert_bitwise_equal(targets[k], v, k)
    helpers.assert_bitwise_equal(targets["cast"], sd["buffer"].to(torch.float64).cuda())
    assert not base[:, 0].any() and not base[:, 2].any()  # nothing outside the target written


@pytest.mark.parametrize("staging_bytes, staging_buffers", [(4096, 1), (4096, 3), (MIB, 2)])
def test_load_to_cuda(tmp_path, staging_bytes, staging_buffers):
    sd = _mixed_state_dict(4096)
    mmapckpt.save(sd, tmp_path / "c")
    out = mmapckpt.load(tmp_path / "c", device="cuda", staging_bytes=staging_bytes, staging_buffers=staging_buffers)
    assert set(out) == set(sd)
    for k, v in sd.items():
        assert out[k].device.type == "cuda"
        helpers.assert_bitwise_equal(out[k], v.contiguous(), k)


# --------------------------------------------------------------------------- pinned memory
def _host_allocated(stats: dict, which: str = "current") -> int:
    """The pinned allocator's bytes (active + cached); the key's name differs across torch versions."""
    for key in (f"allocated_bytes.{which}", f"allocated_bytes.all.{which}"):
        if key in stats:
            return int(stats[key])
    pytest.skip(f"torch.cuda.host_memory_stats() has no allocated_bytes.{which} in torch {torch.__version__}")


def _need_host_stats() -> None:
    torch.cuda.init()  # host_memory_stats() is empty before CUDA is initialised
    if not hasattr(torch.cuda, "reset_peak_host_memory_stats"):
        pytest.skip(f"torch {torch.__version__} has no pinned-memory statistics")


def _settle(*, required: bool) -> None:
    """Free what is unreferenced and return cached pinned blocks, so that allocated bytes are held bytes.

    Without a way to empty the pinned cache, allocated bytes include cached blocks: still an
    upper bound on what a load adds (``required=False``), but no longer a measure of what is held.
    """
    gc.collect()
    torch.cuda.synchronize()
    empty = (getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)
             or getattr(torch._C, "_host_emptyCache", None))
    if empty is not None:
        empty()
    elif required:
        pytest.skip(f"no way to empty the pinned-memory cache in torch {torch.__version__}")


def _big_checkpoint(tmp_path, bound: int) -> tuple[dict[str, torch.Tensor], str]:
    """A checkpoint ten times ``bound`` (plus a few small tensors)."""
    sd = {f"w{i}": _raw("bfloat16", (bound // 2,), i) for i in range(10)} | _mixed_state_dict(4096)
    path = str(tmp_path / "big")
    mmapckpt.save(sd, path)
    return sd, path


def _load_by(how: str, sd: dict, path: str, nbytes: int, count: int) -> MmapReader | None:
    if how == "load":
        out = mmapckpt.load(path, device="cuda", staging_bytes=nbytes, staging_buffers=count)
        for k, v in sd.items():
            helpers.assert_bitwise_equal(out[k], v.contiguous(), k)
        return None
    targets = {k: _filled(v.shape, v.dtype, 0xA5) for k, v in sd.items()}
    reader = None
    if how == "dcp":
        reader = MmapReader(path, staging_bytes=nbytes, staging_buffers=count)
        helpers.dcp_load(targets, reader)
    else:
        mmapckpt.load_into(targets, path, staging_bytes=nbytes, staging_buffers=count)
    for k, v in sd.items():
        helpers.assert_bitwise_equal(targets[k], v, k)
    return reader


@pytest.mark.parametrize("how", ["dcp", "load_into", "load"])
def test_pinned_memory_stays_at_the_bound(tmp_path, how):
    nbytes, count = MIB, 3  # a power of two: the pinned allocator rounds blocks up to one
    bound = nbytes * count
    sd, path = _big_checkpoint(tmp_path, bound)
    _need_host_stats()
    _settle(required=False)
    before = _host_allocated(torch.cuda.host_memory_stats())
    torch.cuda.reset_peak_host_memory_stats()
    reader = _load_by(how, sd, path, nbytes, count)
    peak = _host_allocated(torch.cuda.host_memory_stats(), "peak")
    assert peak - before <= bound + MIB, f"{how}: {peak - before} pinned bytes for a bound of {bound}"
    if reader is not None:
        pool = _only_pool(reader)
        assert sum(b.numel() for b in pool.buffers) == bound and pool.max_in_use <= count
        assert sum(pool.blocks_per_buffer) >= 10 * 3  # the ring really was cycled
        reader.close()


@pytest.mark.parametrize("drop", ["close", "del"])
def test_no_pinned_memory_is_left_after_the_reader(tmp_path, drop):
    sd, path = _big_checkpoint(tmp_path, 3 * MIB)
    _need_host_stats()
    _settle(required=True)
    before = _host_allocated(torch.cuda.host_memory_stats())
    reader = _load_by("dcp", sd, path, MIB, 3)
    assert _host_allocated(torch.cuda.host_memory_stats()) >= before + 3 * MIB  # the ring is held between loads
    if drop == "close":
        reader.close()
    del reader
    _settle(required=True)
    assert _host_allocated(torch.cuda.host_memory_stats()) == before


# --------------------------------------------------------------------------- stream ordering
def _late_write_on_current_stream(dst: torch.Tensor, value: float) -> None:
    """Queue ``dst.fill_(value)`` on the current stream behind ~100 ms of device work."""
    if hasattr(torch.cuda, "_sleep"):
        torch.cuda._sleep(200_000_000)  # spin cycles on the current stream
    else:
        a = torch.randn(4096, 4096, device="cuda")
        for _ in range(20):
            a = a @ a / 64
    dst.fill_(value)


@pytest.mark.parametrize("how", ["dcp", "load_into"])
def test_the_current_stream_is_ordered_before_the_staged_copies(tmp_path, how):
    """The destination written on the current stream just before the load must not overwrite the load."""
    n = 4 * MIB  # 16 MiB of float32: many blocks through 1 MiB buffers
    mmapckpt.save({"w": torch.full((n,), 2.0)}, tmp_path / "c")
    dst = torch.empty(n, device="cuda")
    reader = MmapReader(tmp_path / "c", staging_bytes=MIB, staging_buffers=2) if how == "dcp" else None
    for attempt in range(2):  # the second dcp.load reuses the reader's ring (ordered again in read_data)
        _late_write_on_current_stream(dst, 1.0)
        if reader is not None:
            helpers.dcp_load({"w": dst}, reader)
        else:
            mmapckpt.load_into({"w": dst}, tmp_path / "c", staging_bytes=MIB, staging_buffers=2)
        torch.cuda.synchronize()
        assert bool((dst == 2.0).all()), f"{how}, load {attempt}: the current stream's fill overtook the copy"
    if reader is not None:
        reader.close()
