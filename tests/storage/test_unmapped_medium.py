"""Every reader goes through the storage seam: a medium that cannot map files gives the same bytes.

``Unmapped`` (tests/unmapped.py) is a second implementation of ``storage/base.py``'s
``CheckpointStorage`` for a location reached as ``unmapped://DIR``: its files have no mapping (as
on an object store), so every byte must come through ``StoredFile.read_into``, which it counts.
``dcp.load`` with ``MmapReader``, ``open``/``get_tensor``/``get_slice``, ``load`` and ``load_into`` read an mmapckpt
checkpoint and a stock DCP one through it, bitwise equal to the local reads, and each read
only through the seam (the bytes it counts; no file of the directory opened otherwise).
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import assert_tree_equal, tensor_bytes

import mmapckpt
from mmapckpt.reading.shard import Shard


def _sd() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {"a": torch.randn(64, 33, generator=g).to(torch.bfloat16),
            "b": torch.tensor([float("nan"), -0.0, 1.5, -2.0]),
            "c": torch.arange(1000, dtype=torch.int64).reshape(10, 100),
            "e": torch.empty(0, 5)}


@pytest.fixture(params=["mmapckpt", "stock"])
def ckpt(request, tmp_path) -> tuple[str, dict[str, torch.Tensor]]:
    sd = _sd()
    path = str(tmp_path / "c")
    writer = mmapckpt.MmapWriter(path) if request.param == "mmapckpt" else dcp.FileSystemWriter(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, storage_writer=writer, no_dist=True)
    return path, sd


def _stored_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path))


def test_dcp_load_reads_every_byte_through_the_seam(medium, ckpt) -> None:
    path, sd = ckpt
    got = {k: torch.full_like(v, 7) for k, v in sd.items()}
    reader = mmapckpt.MmapReader("unmapped://" + path)
    assert mmapckpt.MmapReader.validate_checkpoint_id("unmapped://" + path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(got, storage_reader=reader, no_dist=True)
    assert_tree_equal(got, sd)
    assert 0 < medium[0] <= _stored_bytes(path)  # everything came through read_into, nothing twice per byte


def test_lazy_loaders_read_through_the_seam(medium, ckpt) -> None:
    path, sd = ckpt
    url = "unmapped://" + path
    with mmapckpt.open(url) as f:
        assert f.keys() == list(sd)
        for k, v in sd.items():
            t = f.get_tensor(k)
            assert tensor_bytes(t) == tensor_bytes(v) and t.dtype == v.dtype and t.shape == v.shape
        assert tensor_bytes(f.get_slice("c")[2:5, ::7]) == tensor_bytes(sd["c"][2:5, ::7])
    assert_tree_equal(mmapckpt.load(url), sd)
    targets = {k: torch.full_like(v, 3) for k, v in sd.items()}
    assert mmapckpt.load_into(targets, url) == []
    assert_tree_equal(targets, sd)
    assert medium[0] > 0


def test_views_of_a_medium_without_mappings_are_new_tensors(medium, tmp_path) -> None:
    """On a local directory get_tensor returns a view of the file mapping; here it must be memory of its own."""
    path = str(tmp_path / "c")
    mmapckpt.save({"w": torch.arange(4096, dtype=torch.float32)}, path)
    with mmapckpt.open(path) as f:
        local_view = f.get_tensor("w")
    with mmapckpt.open("unmapped://" + path) as f:
        before = medium[0]
        t = f.get_tensor("w")
        assert medium[0] - before == 4096 * 4  # read whole, through the seam
    t += 1  # its own memory: the file is unchanged
    assert torch.equal(local_view, torch.arange(4096, dtype=torch.float32))


def test_verify_style_checksums_hold_through_the_seam(medium, tmp_path) -> None:
    """verify=True reads each entry's bytes through read_into and checks its CRC-32, as on a local directory."""
    path = str(tmp_path / "c")
    mmapckpt.save(_sd(), path)
    assert_tree_equal(mmapckpt.load("unmapped://" + path, verify=True), _sd())
    shard = os.path.join(path, "__0_0.distcp")
    e = next(e for e in Shard(shard).header.entries if e.fqn == "c")
    with open(shard, "r+b") as f:  # flip one bit of c's data
        f.seek(e.offset + 100)
        b = f.read(1)
        f.seek(e.offset + 100)
        f.write(bytes([b[0] ^ 1]))
    assert tensor_bytes(mmapckpt.load(path)["c"]) != tensor_bytes(_sd()["c"])  # the flip is in c
    with pytest.raises(mmapckpt.ChecksumError):
        mmapckpt.load("unmapped://" + path, verify=True)


def test_an_unknown_scheme_is_still_refused(tmp_path) -> None:
    with pytest.raises(mmapckpt.CheckpointError, match="is a URL"):
        mmapckpt.load("unmapped://" + str(tmp_path))


def test_saves_write_through_the_seam(medium, tmp_path) -> None:
    """MmapWriter and mmapckpt.save on the medium: the same files a local save writes, loaded back bitwise."""
    path = str(tmp_path / "c")
    url = "unmapped://" + path
    assert mmapckpt.MmapWriter.validate_checkpoint_id(url)
    sd = _sd()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, storage_writer=mmapckpt.MmapWriter(url), no_dist=True)
    assert_tree_equal(mmapckpt.load(path), sd)
    mmapckpt.save({k: v + 1 for k, v in sd.items() if v.is_floating_point()}, url)  # over it: old or new
    assert_tree_equal(mmapckpt.load(url), {k: v + 1 for k, v in sd.items() if v.is_floating_point()})
    names = sorted(os.listdir(path))  # the new shard took a new name; the old one was removed after the commit
    assert len(names) == 2 and names[0] == ".metadata" and names[1].startswith("__0_0.") and names[1] != "__0_0.distcp"


def test_open_reads_the_commit_once_and_the_shard_headers_only(medium, tmp_path) -> None:
    """``open`` reads the metadata once (its kind from the first 8 bytes), each shard's preamble and header (the
    shards of an mmapckpt commit are not probed for their magic first), and no tensor byte: what it reads through
    the seam is exactly that."""
    path = str(tmp_path / "c")
    mmapckpt.save(_sd(), path)
    meta = os.path.getsize(os.path.join(path, ".metadata"))
    headers = sum(Shard(os.path.join(path, n)).data_start for n in os.listdir(path) if n.endswith(".distcp"))
    with mmapckpt.open("unmapped://" + path) as f:
        assert medium[0] == 8 + meta + headers
        assert f.keys() == list(_sd())
