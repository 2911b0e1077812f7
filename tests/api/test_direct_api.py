"""``mmapckpt.save`` and ``mmapckpt.load_into``: the single-process paths without DCP planning.

Their checkpoints and loads are compared with what ``dcp.save``/``dcp.load`` (with
MmapWriter/MmapReader and with the stock FileSystemWriter/Reader) make of the same input.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mmapckpt
from helpers import assert_bitwise_equal, dcp_load, dcp_save
from mmapckpt.dcp.metadata import read_metadata_file
from strategies import fresh_like, tensors

SHARD = "__0_0.distcp"
_CFG = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                       HealthCheck.too_slow])


def _flat_state(draw: st.DrawFn) -> dict[str, torch.Tensor]:
    names = draw(st.lists(st.from_regex(r"[a-z]{1,6}(\.[a-z0-9]{1,4}){0,2}", fullmatch=True), min_size=1,
                          max_size=6, unique=True))
    return {n: draw(tensors()) for n in names}


flat_states = st.composite(_flat_state)


@_CFG
@given(sd=flat_states())
def test_save_writes_what_dcp_save_writes(tmp_path_factory, sd):
    """Same metadata (but for the save's ids), same data bytes at the same offsets, loadable by both paths."""
    root = tmp_path_factory.mktemp("s")
    a, b = str(root / "api"), str(root / "dcp")
    mmapckpt.save(sd, a)
    dcp_save(sd, mmapckpt.MmapWriter(b))
    ma, mb = read_metadata_file(os.path.join(a, ".metadata"))[1], read_metadata_file(os.path.join(b, ".metadata"))[1]
    assert ma.state_dict_metadata == mb.state_dict_metadata
    assert ma.storage_data == mb.storage_data
    hints = [sorted((k.fqn, k.offset, k.index) for k in md.storage_data) for md in (ma, mb)]
    assert hints[0] == hints[1]  # MetadataIndex equality ignores the index hint: compared here
    assert (ma.planner_data, ma.version) == (mb.planner_data, mb.version)
    assert ma.storage_meta.save_id != mb.storage_meta.save_id
    for info in ma.storage_data.values():
        with open(os.path.join(a, info.relative_path), "rb") as fa, open(os.path.join(b, info.relative_path), "rb") as fb:
            fa.seek(info.offset)
            fb.seek(info.offset)
            assert fa.read(info.length) == fb.read(info.length)
    loaded = dcp_load(fresh_like(sd, 0xA5), mmapckpt.MmapReader(a))
    for k, v in sd.items():
        assert_bitwise_equal(loaded[k], v, k)
    assert mmapckpt.verify_checkpoint(a).ok


@_CFG
@given(sd=flat_states(), fill=st.integers(0, 255))
def test_load_into_fills_targets_as_dcp_load_does(tmp_path_factory, sd, fill):
    """Bitwise the saved values, and the same bytes dcp.load leaves, from mmapckpt and stock checkpoints."""
    root = tmp_path_factory.mktemp("l")
    mm, stock = str(root / "mm"), str(root / "stock")
    dcp_save(sd, mmapckpt.MmapWriter(mm))
    dcp_save(sd, dcp.FileSystemWriter(stock))
    for path in (mm, stock):
        into = fresh_like(sd, fill)
        assert mmapckpt.load_into(into, path) == []
        ref = dcp_load(fresh_like(sd, fill), dcp.FileSystemReader(stock))
        for k, v in sd.items():
            assert_bitwise_equal(into[k], v, f"{path}: {k}")
            assert_bitwise_equal(into[k], ref[k], f"{path}: {k} against the stock reader")


def test_load_into_non_contiguous_and_cast_targets(tmp_path):
    sd = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.arange(5, dtype=torch.int64)}
    mmapckpt.save(sd, tmp_path / "c")
    w = torch.zeros(4, 3).t()  # a transposed view: not contiguous, so copied from the mapping
    b = torch.zeros(5, dtype=torch.float64)  # another dtype: cast as Tensor.copy_ casts
    mmapckpt.load_into({"w": w, "b": b}, tmp_path / "c")
    assert not w.is_contiguous() and torch.equal(w, sd["w"])
    assert b.dtype == torch.float64 and torch.equal(b, sd["b"].double())


def test_load_into_reads_a_cold_file(tmp_path):
    """The uncached path (read ahead, one stream in file order) gives the same bytes."""
    g = torch.Generator().manual_seed(3)
    sd = {f"t{i}": torch.randn(300 + i, 257, generator=g) for i in range(6)}
    path = str(tmp_path / "c")
    mmapckpt.save(sd, path)
    fd = os.open(os.path.join(path, SHARD), os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    into = fresh_like(sd, 0x5A)
    mmapckpt.load_into(into, path)
    for k, v in sd.items():
        assert_bitwise_equal(into[k], v, k)


def test_load_into_missing_names_and_wrong_shapes(tmp_path):
    mmapckpt.save({"w": torch.ones(2, 3)}, tmp_path / "c")
    with pytest.raises(KeyError, match="nope"):
        mmapckpt.load_into({"w": torch.zeros(2, 3), "nope": torch.zeros(1)}, tmp_path / "c")
    w = torch.zeros(2, 3)
    assert mmapckpt.load_into({"w": w, "nope": torch.zeros(1), "step": 7}, tmp_path / "c", strict=False) == ["nope"]
    assert torch.equal(w, torch.ones(2, 3))
    with pytest.raises(mmapckpt.SizeMismatchError) as ei:
        mmapckpt.load_into({"w": torch.zeros(3, 2)}, tmp_path / "c")
    assert ei.value.entry == "w" and "[2, 3]" in str(ei.value)


def test_load_into_refuses_object_entries(tmp_path):
    dcp_save({"w": torch.ones(2), "cfg": {"lr": 0.1}}, mmapckpt.MmapWriter(tmp_path / "c"))
    with pytest.raises(mmapckpt.CheckpointError) as ei:
        mmapckpt.load_into({"cfg.lr": torch.zeros(1)}, tmp_path / "c")
    assert ei.value.entry == "cfg.lr"


def test_save_refuses_what_only_dcp_can_store(tmp_path):
    with pytest.raises(TypeError, match="step"):
        mmapckpt.save({"w": torch.ones(2), "step": 3}, tmp_path / "c")
    assert not os.path.exists(tmp_path / "c" / ".metadata")


def test_save_overwrite_false_refuses_an_existing_checkpoint(tmp_path):
    mmapckpt.save({"w": torch.ones(2)}, tmp_path / "c")
    with pytest.raises(mmapckpt.CheckpointExistsError):
        mmapckpt.save({"w": torch.zeros(2)}, tmp_path / "c", overwrite=False)
    mmapckpt.save({"w": torch.zeros(2)}, tmp_path / "c")  # the default replaces it
    assert torch.equal(mmapckpt.load(tmp_path / "c")["w"], torch.zeros(2))


def test_a_tensor_described_with_no_chunks_is_refused(tmp_path):
    """Metadata that describes a tensor but stores none of it (no chunk, no record) is a FormatError
    for every reader: dcp.load would otherwise plan no read for it and leave the target as it was."""
    import json

    from helpers import as_metadata_v1, metadata_with_doc

    path = tmp_path / "c"
    mmapckpt.save({"w": torch.ones(2, 3), "b": torch.ones(4)}, path)
    as_metadata_v1(path)  # the version-1 form can describe a tensor with no chunks
    raw = (path / ".metadata").read_bytes()
    doc = json.loads(raw[24:])
    doc["state_dict_metadata"]["w"]["chunks"] = []
    doc["storage_data"] = [r for r in doc["storage_data"] if r["fqn"] != "w"]
    (path / ".metadata").write_bytes(metadata_with_doc(raw, doc))
    for load in (lambda: mmapckpt.load(path), lambda: mmapckpt.load_into({"w": torch.zeros(2, 3)}, path),
                 lambda: mmapckpt.MmapReader(path).read_metadata()):
        with pytest.raises(mmapckpt.FormatError, match="entry 'w': the chunks hold 0 of the tensor's 6 elements"):
            load()


def _warm(path) -> None:
    for name in os.listdir(path):
        with open(os.path.join(path, name), "rb") as f:
            while f.read(1 << 20):
                pass


@pytest.mark.parametrize("batch", [1, 4096, 1 << 20])
def test_cached_reads_started_during_the_walk(tmp_path, monkeypatch, batch):
    """With small batches, cached reads start on the reader threads while the plan is still walked."""
    from mmapckpt.io import direct_reads as _direct

    started = []
    real = _direct.byte_runs  # cut once per batch started
    monkeypatch.setattr(_direct, "_BATCH", batch)
    monkeypatch.setattr(_direct, "SMALL_CACHED_COPY", 0)  # these small tensors too go through reads
    monkeypatch.setattr(_direct, "byte_runs", lambda *a, **k: started.append(len(a[0])) or real(*a, **k))
    g = torch.Generator().manual_seed(5)
    sd = {f"t{i}": torch.randn(64 + 7 * i, 33, generator=g).to(torch.bfloat16) for i in range(40)}
    path = str(tmp_path / "c")
    mmapckpt.save(sd, path)
    _warm(path)
    for load in (lambda out: dcp_load(out, mmapckpt.MmapReader(path)), lambda out: mmapckpt.load_into(out, path)):
        started.clear()
        out = fresh_like(sd, 0x3C)
        load(out)
        for k, v in sd.items():
            assert_bitwise_equal(out[k], v, k)
        fd = os.open(os.path.join(path, SHARD), os.O_RDONLY)
        try:
            probe_works = _direct.is_cached(fd, [0])  # False where RWF_NOWAIT is unsupported
        finally:
            os.close(fd)
        if probe_works:  # 1 B and 4 KiB batches start during the walk; 1 MiB (> the 0.5 MiB) only at its end
            assert len(started) > 3 if batch < (1 << 20) else len(started) == 1, started


def test_small_regions_of_a_cached_file_are_copied_from_the_mapping(tmp_path, monkeypatch):
    """Queueing a read costs more than copying a few cached pages: below SMALL_CACHED_COPY no read is made."""
    from mmapckpt.io import direct_reads as _direct

    taken = []
    real = _direct.DirectReads.run
    monkeypatch.setattr(_direct.DirectReads, "run", lambda self: taken.append(len(self.jobs)) or real(self))
    sd = {"small": torch.randn(16), "big": torch.randn(_direct.SMALL_CACHED_COPY // 4 + 1)}
    path = str(tmp_path / "c")
    mmapckpt.save(sd, path)
    _warm(path)
    fd = os.open(os.path.join(path, SHARD), os.O_RDONLY)
    try:
        if not _direct.is_cached(fd, [0]):
            pytest.skip("RWF_NOWAIT probes are unsupported here: every file counts as cold")
    finally:
        os.close(fd)
    out = fresh_like(sd, 0x3C)
    mmapckpt.load_into(out, path)
    assert taken == [1]  # only "big" went through a read
    for k, v in sd.items():
        assert_bitwise_equal(out[k], v, k)


def test_an_error_after_reads_started_waits_for_them_and_is_raised(tmp_path, monkeypatch):
    """A chunk refused late in the walk: the reads already running finish before the descriptor closes."""
    import json
    import struct

    from mmapckpt.io import direct_reads as _direct
    from helpers import shard_with_header

    monkeypatch.setattr(_direct, "_BATCH", 1)
    sd = {f"t{i}": torch.full((256, 16), float(i)) for i in range(12)}
    path = tmp_path / "c"
    mmapckpt.save(sd, path)
    raw = (path / SHARD).read_bytes()
    (hlen,) = struct.unpack_from("<Q", raw, 16)
    doc = json.loads(raw[32:32 + hlen])
    next(e for e in doc["entries"] if e["fqn"] == "t11")["dtype"] = "int32"  # same length, valid CRC
    (path / SHARD).write_bytes(shard_with_header(raw, doc))
    _warm(path)
    with pytest.raises(mmapckpt.FormatError, match="int32"):
        mmapckpt.load_into(fresh_like(sd), path)
    with pytest.raises(BaseException) as ei:
        dcp_load(fresh_like(sd), mmapckpt.MmapReader(path))
    assert "int32" in str(ei.value)


@pytest.mark.timeout(120)
def test_a_forked_child_loads_with_reader_threads_of_its_own(tmp_path):
    """The reader pool is per process: a child forked after the parent's cached loads (a DataLoader
    worker, say) gets new threads instead of waiting forever on the parent's, which it does not have."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(f"""
        import os, sys, torch
        import mmapckpt
        from mmapckpt.io import direct_reads as _direct
        path = {str(tmp_path / "c")!r}
        sd = {{f"t{{i}}": torch.full((512, 64), float(i)) for i in range(8)}}
        mmapckpt.save(sd, path)
        for name in os.listdir(path):
            open(os.path.join(path, name), "rb").read()
        _direct._BATCH = 1  # every read goes to the pool
        out = {{k: torch.zeros_like(v) for k, v in sd.items()}}
        mmapckpt.load_into(out, path)  # starts the parent's reader threads
        pid = os.fork()
        if pid == 0:
            import signal
            signal.alarm(60)  # a hung child dies (SIGALRM) instead of outliving the test
            out = {{k: torch.zeros_like(v) for k, v in sd.items()}}
            mmapckpt.load_into(out, path)
            os._exit(0 if all(torch.equal(out[k], sd[k]) for k in sd) else 3)
        _, status = os.waitpid(pid, 0)
        sys.exit(os.waitstatus_to_exitcode(status))
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=100)
    assert r.returncode == 0, r.stderr[-2000:]


def _dtensor_refusals(rank: int, world: int, path: str) -> None:
    """On a real gloo rank: a DTensor is refused by save and load_into, with the way to go instead."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    d = distribute_tensor(torch.arange(8.0), init_device_mesh("cpu", (world,)), [Shard(0)])
    with pytest.raises(TypeError, match="dcp.save"):
        mmapckpt.save({"w": d}, path + "-dt")
    assert not os.path.exists(path + "-dt/.metadata")
    with pytest.raises(TypeError, match="dcp.load"):
        mmapckpt.load_into({"w": d}, path)


@pytest.mark.distributed
def test_dtensors_are_refused_with_the_dcp_way_named(tmp_path):
    import helpers

    path = str(tmp_path / "c")
    mmapckpt.save({"w": torch.arange(8.0)}, path)
    helpers.run_distributed(_dtensor_refusals, 1, path)


def test_direct_reads_of_a_shard_removed_after_mapping_read_the_file_mapped(tmp_path):
    """A later save's clean-up may unlink a shard a load has mapped: direct reads go through the descriptor the
    file was mapped with (never its path again), so they still read that file."""
    from mmapckpt.reading.shard import Shard
    from mmapckpt.io.direct_reads import DirectReads

    sd = {"w": torch.randn(70_000)}
    path = str(tmp_path / "c")
    mmapckpt.save(sd, path)
    shard = Shard(os.path.join(path, SHARD))
    os.unlink(os.path.join(path, SHARD))
    reads = DirectReads(shard.file, ranges=[(4096, 280_000)])
    assert reads.enabled
    e = shard.header.entries[0]
    target = torch.empty(70_000)
    src = shard.tensor(e)
    try:
        assert reads.take(src, target, None, "w")
        reads.run()
    finally:
        reads.close()
        shard.close()
    assert_bitwise_equal(target, sd["w"])
