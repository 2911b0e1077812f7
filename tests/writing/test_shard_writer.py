"""writing/shard.py write_shard, the one shard writer: what it writes, byte for byte, what it holds while
writing, and how it fails."""

from __future__ import annotations

import errno
import gc
import os
import time
import weakref
import zlib

import numpy as np
import pytest
import torch

from mmapckpt import ChecksumError, CheckpointWriteError
from mmapckpt.format import layout as fmt
from mmapckpt.reading.shard import Shard
from mmapckpt.storage.local import LocalOutput, LocalStorage
from mmapckpt.writing import shard as shard_mod
from mmapckpt.writing.shard import ShardEntry, ShardOptions, write_shard
from mmapckpt.writing.tensors import tensor_bytes

MiB = 1 << 20


def _tensor_entry(fqn: str, t: torch.Tensor, key: object = None) -> ShardEntry:
    return ShardEntry(fqn, (0,) * t.dim(), fmt.KIND_TENSOR, fmt.dtype_name(t.dtype), tuple(t.shape), t.nbytes,
                      fqn if key is None else key)


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {"big": torch.randn(3 * MiB // 4 + 7, generator=g),  # over the CRC thread's threshold, odd length
            "bf16": torch.randn(4097, generator=g).to(torch.bfloat16),
            "cols": torch.randn(64, 65, generator=g).t(),  # not contiguous: its logical values are stored
            "empty": torch.empty(0, 3), "scalar": torch.tensor(2.5, dtype=torch.float64)}


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("alignment", [64, 4096])
def test_entries_payloads_and_aliases_round_trip_byte_for_byte(tmp_path, direct, alignment) -> None:
    sd = _state()
    payload = b"\x80\x04 a pickled value"
    entries = [_tensor_entry(k, v) for k, v in sd.items()]
    entries.insert(2, ShardEntry("step", None, fmt.KIND_BYTES, None, (), len(payload), payload))
    entries.append(_tensor_entry("tied", sd["big"], key="big"))  # an alias of entry 0: its bytes once
    advanced: list[int] = []
    resolved: list[object] = []
    done, how = write_shard(LocalStorage(tmp_path), "__0_0.distcp", entries,
                            lambda k: resolved.append(k) or sd[k], save_id="s1",  # type: ignore[func-returns-value]
                            options=ShardOptions(alignment, direct, True), aliases={len(entries) - 1: 0},
                            advance=advanced.append)
    assert how in (("direct", "buffered") if direct else ("buffered",))
    assert resolved == list(sd)  # once each, in order; the alias is not resolved
    assert sum(advanced) == sum(v.nbytes for v in sd.values()) + sd["big"].nbytes
    assert [e.key for e in done] == [(e.fqn, e.chunk_offsets) for e in entries]  # input order
    assert sorted(os.listdir(tmp_path)) == ["__0_0.distcp"]  # no temporary file left
    shard = Shard(str(tmp_path / "__0_0.distcp"))
    assert shard.save_id == "s1" and list(shard.header.entries) == done  # the header, CRC-32s included
    raw = (tmp_path / "__0_0.distcp").read_bytes()
    assert len(raw) % alignment == 0
    for e in done:
        want = payload if e.kind == fmt.KIND_BYTES else bytes(tensor_bytes(sd["big" if e.fqn == "tied" else e.fqn]))
        assert raw[e.offset:e.offset + e.length] == want, e.fqn
        assert e.crc32 == zlib.crc32(want) and e.offset % (alignment if e.length >= alignment else 64) == 0
    big, tied = done[0], done[-1]
    assert (tied.offset, tied.length, tied.crc32) == (big.offset, big.length, big.crc32)


def test_the_bytes_are_those_the_header_describes_whatever_the_write_path(tmp_path) -> None:
    """Direct and buffered writes of the same entries leave the same file."""
    sd = _state()
    files = []
    for direct in (True, False):
        write_shard(LocalStorage(tmp_path), f"{direct}.distcp", [_tensor_entry(k, v) for k, v in sd.items()],
                    sd.__getitem__, save_id=None, options=ShardOptions(4096, direct, False))
        files.append((tmp_path / f"{direct}.distcp").read_bytes())
    assert files[0] == files[1]


def _slow_checksums(monkeypatch) -> None:
    real = shard_mod._crc_of
    monkeypatch.setattr(shard_mod, "_crc_of", lambda held: time.sleep(0.05) or real(held))


@pytest.mark.parametrize("one_at_a_time", [True, False])
def test_one_at_a_time_lets_each_read_tensor_go_before_the_next_is_read(tmp_path, monkeypatch, one_at_a_time):
    """A conversion's resolve reads each tensor into new memory: with ``one_at_a_time`` none of them is still
    held (by the writer's loop, by stage_to_host, by a checksum still running) when the next is read, even
    with checksums slower than the writes. Without it checksums may lag, holding their tensors."""
    _slow_checksums(monkeypatch)
    alive: list[weakref.ref] = []
    held_at_resolve: list[int] = []

    def read(i: int) -> torch.Tensor:
        gc.collect()
        held_at_resolve.append(sum(r() is not None for r in alive))
        a = np.full(MiB // 2, float(i), dtype=np.float32)  # 2 MiB: its checksum goes to the checksum thread
        alive.append(weakref.ref(a))  # the memory itself: every view of the tensor's bytes keeps it
        return torch.from_numpy(a)

    entries = [ShardEntry(f"w{i}", (0,), fmt.KIND_TENSOR, "float32", (MiB // 2,), 2 * MiB, i) for i in range(4)]
    done, _ = write_shard(LocalStorage(tmp_path), "s.distcp", entries, read, save_id=None,
                          options=ShardOptions(4096, False, False), one_at_a_time=one_at_a_time)
    if one_at_a_time:
        assert held_at_resolve == [0, 0, 0, 0]
    else:
        assert max(held_at_resolve) >= 1  # what the test would see if the writer held on
    assert [e.crc32 for e in done] == [zlib.crc32(torch.full((MiB // 2,), float(i)).numpy()) for i in range(4)]


class _FullAfter(LocalStorage):
    """A directory whose shard outputs fail with ENOSPC at their ``n``-th piece."""

    def __init__(self, location, n: int) -> None:
        super().__init__(location)
        self.n, self.outputs = n, []

    def create_file(self, name, size, *, head, direct, sync):
        out = super().create_file(name, size, head=head, direct=direct, sync=sync)
        self.outputs.append(out)
        real, calls = out.put, [0]

        def put(offset, data):
            calls[0] += 1
            if calls[0] == self.n:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            real(offset, data)
        out.put = put  # type: ignore[method-assign]
        return out


@pytest.mark.parametrize("transforms", [False, True])
def test_a_failed_piece_aborts_the_file_and_names_the_shard_and_the_entry(tmp_path, transforms) -> None:
    sd = _state()
    opts = ShardOptions(4096, False, True)
    if transforms:
        zstd = pytest.importorskip("torch.distributed.checkpoint._extension")
        from mmapckpt.format.transforms import StreamTransforms
        try:
            opts = ShardOptions(4096, False, True, StreamTransforms((zstd.ZStandard(),)))
        except Exception as e:  # no zstandard module
            pytest.skip(f"no ZStandard here: {e}")
    storage = _FullAfter(tmp_path, 2)
    entries = [_tensor_entry(k, v) for k, v in sd.items()]
    with pytest.raises(CheckpointWriteError) as info:
        write_shard(storage, "__0_0.distcp", entries, sd.__getitem__, save_id=None, options=opts)
    err = info.value
    assert "writing shard failed" in str(err) and os.strerror(errno.ENOSPC) in str(err), str(err)
    assert err.path == str(tmp_path / "__0_0.distcp")
    assert err.entry in [e.label for e in entries[:2]]  # the entry whose piece failed (or its padding before it)
    assert isinstance(err.__cause__, OSError) and err.__cause__.errno == errno.ENOSPC
    assert os.listdir(tmp_path) == [] and isinstance(storage.outputs[0], LocalOutput)


def test_a_checkpoint_error_of_a_read_passes_as_it_is_and_the_file_is_aborted(tmp_path) -> None:
    damaged = ChecksumError("data does not match its checksum", path="/src/__0_0.distcp", entry="b@[0]")

    def read(k: str) -> torch.Tensor:
        if k == "bf16":
            raise damaged
        return _state()[k]

    with pytest.raises(ChecksumError) as info:
        write_shard(LocalStorage(tmp_path), "x.distcp", [_tensor_entry(k, v) for k, v in _state().items()], read,
                    save_id=None, options=ShardOptions())
    assert info.value is damaged and os.listdir(tmp_path) == []


def test_a_tensor_other_than_the_one_laid_out_is_refused_by_name(tmp_path) -> None:
    entries = [ShardEntry("w", (0,), fmt.KIND_TENSOR, "float32", (4,), 16, "w")]
    with pytest.raises(CheckpointWriteError, match=r"resolved 'w' to \(5,\) torch.float32") as info:
        write_shard(LocalStorage(tmp_path), "x.distcp", entries, lambda k: torch.ones(5), save_id=None,
                    options=ShardOptions())
    assert info.value.entry == "w@[0]" and os.listdir(tmp_path) == []
