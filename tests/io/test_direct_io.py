"""O_DIRECT shard writes: the same bytes as a buffered write, and a buffered fallback where refused."""

from __future__ import annotations

import errno
import mmap
import os
import random
import uuid
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

import mmapckpt
from mmapckpt.io import odirect as _io
from helpers import assert_tree_equal


def _dcp_save(sd, writer) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, storage_writer=writer, no_dist=True)


def _dcp_load(targets, reader):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(targets, storage_reader=reader, no_dist=True)
    return targets


@pytest.mark.parametrize("dirty", [False, True])
@pytest.mark.parametrize("seed", range(8))
def test_direct_writer_leaves_the_bytes_a_buffered_write_leaves(tmp_path, seed, dirty) -> None:
    rnd = random.Random(seed)
    head = rnd.choice([32, 100, 4096, 4097, 9000])
    puts, pos = [], head
    for _ in range(rnd.randint(0, 12)):
        pos += rnd.choice([0, 1, 63, 4096, 5000])
        n = rnd.choice([0, 1, 17, 4095, 4096, 70_000, (1 << 20) + 3])
        puts.append((pos, os.urandom(n)))
        pos += n
    file_size = pos + rnd.choice([0, 1, 4096, 10_000])
    header = os.urandom(rnd.randint(1, head))

    fd = _io.open_direct(str(tmp_path / "direct"))
    if fd is None:
        pytest.skip("this filesystem refuses O_DIRECT")
    size = rnd.choice([4096, 65536, 1 << 20])
    _io.release_buffers()
    if dirty:  # bounce buffers kept from an earlier save hold its bytes: nothing may rely on zeros
        for _ in range(2):
            b = mmap.mmap(-1, size)
            b.write(b"\xa5" * size)
            _io.give_back(b)
    sink = _io.DirectWriter(fd, head, buffer_size=size, buffers=2)
    try:
        for off, data in puts:
            sink.put(off, data)
        sink.finish(header, file_size)
    finally:
        sink.close()
        os.close(fd)

    expected = bytearray(file_size)
    expected[:len(header)] = header
    for off, data in puts:
        expected[off:off + len(data)] = data
    assert (tmp_path / "direct").read_bytes() == bytes(expected)


def test_bounce_buffers_serve_the_next_save_only_after_a_finished_one(tmp_path) -> None:
    _io.release_buffers()

    def writer(name):
        fd = _io.open_direct(str(tmp_path / name))
        if fd is None:
            pytest.skip("this filesystem refuses O_DIRECT")
        return fd, _io.DirectWriter(fd, 4096, buffer_size=8192, buffers=2)

    fd, sink = writer("a")
    first = list(sink._pool)
    sink.put(4096, b"x" * 10_000)
    sink.finish(b"h", 14_096)
    sink.close()
    os.close(fd)
    assert sorted(map(id, _io._spare)) == sorted(map(id, first))  # kept, not freed
    fd, sink = writer("b")
    assert sorted(map(id, sink._pool)) == sorted(map(id, first)) and not _io._spare  # reused
    sink.put(4096, b"y" * 100)
    sink.close()  # not finished (an error): a view may still be held, so the buffers are freed
    os.close(fd)
    assert not _io._spare and all(b.closed for b in first)


def test_direct_writer_refuses_a_put_before_the_end(tmp_path) -> None:
    fd = _io.open_direct(str(tmp_path / "f"))
    if fd is None:
        pytest.skip("this filesystem refuses O_DIRECT")
    sink = _io.DirectWriter(fd, 64)
    try:
        sink.put(100, b"abc")
        with pytest.raises(ValueError, match="before the current end"):
            sink.put(101, b"x")
    finally:
        sink.close()
        os.close(fd)


def _state_dict() -> dict:
    g = torch.Generator().manual_seed(3)
    return {
        "big": torch.randn(3, 70_001, generator=g),  # spans several bounce buffers, odd length
        "bf16": torch.randn(4097, generator=g).to(torch.bfloat16),
        "small": torch.arange(5, dtype=torch.int16),
        "empty": torch.empty(0, 3),
        "obj": {"step": 7},
        "strided": torch.randn(64, 64, generator=g).t(),  # not contiguous: written through a copy
    }


def _shard_bytes(path) -> dict[str, bytes]:
    return {n: open(os.path.join(path, n), "rb").read() for n in sorted(os.listdir(path)) if n.endswith(".distcp")}


@pytest.mark.parametrize("alignment", [64, 4096, 8192])
def test_direct_and_buffered_saves_write_identical_shards(tmp_path, monkeypatch, alignment) -> None:
    fixed = uuid.UUID(int=alignment)
    monkeypatch.setattr(uuid, "uuid4", lambda: fixed)  # the same save id in both headers
    sd = _state_dict()
    shards = {}
    for direct in (True, False):
        w = mmapckpt.MmapWriter(tmp_path / str(direct), direct_io=direct, alignment=alignment, thread_count=2)
        _dcp_save(sd, w)
        assert w.write_path in ({"direct", "buffered"} if direct else {"buffered"})  # buffered: O_DIRECT refused
        shards[direct] = _shard_bytes(tmp_path / str(direct))
    assert shards[True] == shards[False] and shards[True]
    targets = {k: torch.zeros_like(v) for k, v in sd.items() if isinstance(v, torch.Tensor)}
    out = _dcp_load(targets, mmapckpt.MmapReader(tmp_path / "True", verify=True))
    assert_tree_equal({k: v for k, v in sd.items() if k != "obj"}, out)


def test_refused_o_direct_falls_back_to_buffered(tmp_path, monkeypatch) -> None:
    real_open = os.open

    def refusing_open(path, flags, *a, **kw):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument", path)  # what tmpfs answered before Linux 6.6
        return real_open(path, flags, *a, **kw)

    monkeypatch.setattr(os, "open", refusing_open)
    sd = _state_dict()
    w = mmapckpt.MmapWriter(tmp_path / "ck")
    _dcp_save(sd, w)
    assert w.write_path == "buffered" and set(w.write_paths.values()) == {"buffered"}
    targets = {k: torch.zeros_like(v) for k, v in sd.items() if isinstance(v, torch.Tensor)}
    out = _dcp_load(targets, mmapckpt.MmapReader(tmp_path / "ck", verify=True))
    assert_tree_equal({k: v for k, v in sd.items() if k != "obj"}, out)


@pytest.mark.parametrize("direct_reads", [True, False])
@pytest.mark.parametrize("cold", [True, False])
def test_reader_paths_agree_bitwise(tmp_path, direct_reads, cold) -> None:
    """preadv into targets (cold: one stream; cached: threads) and copies from the mapping."""
    sd = {k: v for k, v in _state_dict().items() if isinstance(v, torch.Tensor)}
    _dcp_save(sd, mmapckpt.MmapWriter(tmp_path / "ck", direct_io=False))
    if cold:
        for n in os.listdir(tmp_path / "ck"):
            fd = os.open(tmp_path / "ck" / n, os.O_RDONLY)
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
    targets = {k: torch.full_like(v, 7) if v.numel() else torch.empty_like(v) for k, v in sd.items()}
    targets["strided"] = torch.zeros(64, 64).t()  # a non-contiguous target takes the copy path
    out = _dcp_load(targets, mmapckpt.MmapReader(tmp_path / "ck", direct_reads=direct_reads))
    for k in sd:
        assert_tree_equal(sd[k], out[k], k)
