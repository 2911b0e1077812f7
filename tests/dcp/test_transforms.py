"""DCP stream transforms: MmapWriter(_extensions=...) and MmapReader(_extension_registry=...).

Items written through transforms are stored encoded and decoded on load; the stock
FileSystemWriter/FileSystemReader with the same transforms are the peers.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._extension import ZStandard
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

import mmapckpt
from helpers import Invert, assert_tree_equal, dcp_failure, dcp_load, dcp_save, invert_registry
from mmapckpt.format import layout as fmt
from strategies import fresh_like, tensor_state_dicts

needs_zstd = pytest.mark.skipif(not ZStandard.is_available(), reason="zstandard is not installed")


def _special_sd():
    fp8 = torch.tensor([0x7F, 0xFF, 0x80, 0x01, 0x00], dtype=torch.uint8).view(torch.float8_e4m3fn)
    return {
        "nan": torch.tensor([0x7FC00001, 0xFFC12345, 0x80000000], dtype=torch.int64).to(torch.uint32)
        .view(torch.float32),
        "bf16": torch.randn(33, 7).to(torch.bfloat16),
        "fp8": fp8,
        "flags": torch.tensor([True, False, True]),
        "empty": torch.empty(0, 4),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "big": torch.arange(300_000, dtype=torch.int64).reshape(600, 500),
        "state": {"step": 7, "name": "adam"},
    }


def _saved(path, extensions, sd=None):
    sd = _special_sd() if sd is None else sd
    dcp_save(sd, mmapckpt.MmapWriter(path, _extensions=extensions))
    return sd


@needs_zstd
def test_zstd_round_trip_is_bitwise_and_matches_the_stock_writer_and_reader(tmp_path):
    ours, stock = tmp_path / "ours", tmp_path / "stock"
    sd = _saved(ours, [ZStandard()])
    dcp_save(sd, FileSystemWriter(stock, _extensions=[ZStandard()]))
    from_ours = dcp_load(fresh_like(sd, 0x5A), mmapckpt.MmapReader(ours))
    from_stock = dcp_load(fresh_like(sd, 0x5A), FileSystemReader(stock))
    assert_tree_equal(from_ours, sd)
    assert_tree_equal(from_ours, from_stock)
    # compressed: the 2.4 MB arange is stored in far fewer bytes
    assert os.path.getsize(ours / "__0_0.distcp") < 1_000_000
    md = mmapckpt.MmapReader(ours).read_metadata()
    assert {tuple(i.transform_descriptors) for i in md.storage_data.values()} == {("stream.zstd/1",)}


@needs_zstd
def test_stock_checkpoints_written_through_transforms_load_through_mmapreader(tmp_path):
    sd = _special_sd()
    dcp_save(sd, FileSystemWriter(tmp_path, _extensions=[ZStandard()]))
    assert_tree_equal(dcp_load(fresh_like(sd, 0x11), mmapckpt.MmapReader(tmp_path)), sd)
    other = tmp_path / "invert"
    dcp_save(sd, FileSystemWriter(other, _extensions=[Invert()]))
    assert_tree_equal(dcp_load(fresh_like(sd, 0x11), mmapckpt.MmapReader(other, _extension_registry=invert_registry())),
                      dcp_load(fresh_like(sd, 0x11), FileSystemReader(other, _extension_registry=invert_registry())))


def test_a_transform_of_ones_own_round_trips_through_its_registry(tmp_path):
    sd = _saved(tmp_path, [Invert()])
    raw = (tmp_path / "__0_0.distcp").read_bytes()
    assert Invert.TRAILER in raw  # stored through the transform
    reader = mmapckpt.MmapReader(tmp_path, _extension_registry=invert_registry())
    assert_tree_equal(dcp_load(fresh_like(sd, 0x33), reader), sd)


@needs_zstd
def test_two_transforms_round_trip_in_order(tmp_path):
    sd = _saved(tmp_path, [ZStandard(), Invert()])
    reg = invert_registry()
    assert_tree_equal(dcp_load(fresh_like(sd, 0x33), mmapckpt.MmapReader(tmp_path, _extension_registry=reg)), sd)


def test_a_transform_the_reader_does_not_know_is_a_clear_error(tmp_path):
    sd = _saved(tmp_path, [Invert()])
    with pytest.raises(BaseException) as info:
        dcp_load(fresh_like(sd), mmapckpt.MmapReader(tmp_path))
    err = dcp_failure(info.value)
    assert isinstance(err, mmapckpt.CheckpointError)
    assert "test.invert/1" in str(err) and "_extension_registry" in str(err) and "__0_0.distcp" in str(err)


def test_a_region_of_an_encoded_chunk_is_narrowed_as_a_mapped_one_is(tmp_path):
    sd = {"w": torch.randn(8, 6)}
    _saved(tmp_path, [Invert()], sd)
    reader = mmapckpt.MmapReader(tmp_path, _extension_registry=invert_registry())
    reader.set_up_storage_reader(reader.read_metadata(), True)
    target = {"w": torch.zeros(3, 4)}

    class Planner(DefaultLoadPlanner):
        def resolve_tensor(self, read_item):
            return target["w"]

    req = ReadItem(type=LoadItemType.TENSOR, dest_index=MetadataIndex("w", (0, 0)), dest_offsets=torch.Size([0, 0]),
                   storage_index=MetadataIndex("w", torch.Size([0, 0])), storage_offsets=torch.Size([2, 1]),
                   lengths=torch.Size([3, 4]))
    reader.read_data(LoadPlan([req]), Planner()).wait()
    assert torch.equal(target["w"].view(torch.int32), sd["w"][2:5, 1:5].contiguous().view(torch.int32))


def test_damaged_encoded_bytes_raise_naming_file_and_entry(tmp_path):
    sd = _saved(tmp_path, [Invert()], {"w": torch.arange(64, dtype=torch.int32)})
    shard = tmp_path / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    at = data.rindex(Invert.TRAILER)
    data[at:at + 7] = b"BROKEN!"  # the trailer no longer strips: the value decodes 7 bytes too long
    shard.write_bytes(bytes(data))
    with pytest.raises(BaseException) as info:
        dcp_load(fresh_like(sd), mmapckpt.MmapReader(tmp_path, _extension_registry=invert_registry()))
    err = dcp_failure(info.value)
    assert isinstance(err, mmapckpt.FormatError) and "w@[0]" in str(err) and "more than" in str(err)
    with pytest.raises(BaseException) as info:
        dcp_load(fresh_like(sd), mmapckpt.MmapReader(tmp_path, verify=True, _extension_registry=invert_registry()))
    assert isinstance(dcp_failure(info.value), mmapckpt.ChecksumError)


def test_readers_that_map_entries_refuse_encoded_ones_instead_of_misreading_them(tmp_path):
    _saved(tmp_path, [Invert()], {"w": torch.arange(64, dtype=torch.int32)})
    with mmapckpt.open(tmp_path) as f:
        with pytest.raises(mmapckpt.FormatError, match="stream transforms"):
            f.get_tensor("w")


def test_encoded_entries_round_trip_through_the_shard_header():
    e = fmt.Entry("w", (0, 2), fmt.KIND_ENCODED, "bfloat16", (3, 4), 4096, 17, 0xDEADBEEF, ("stream.zstd/1",))
    b = fmt.Entry("obj", None, fmt.KIND_ENCODED, None, (), 4160, 5, 1, ("a/1", "b/2"))
    data = fmt.encode_header([e, b])
    minor, order, hlen, hcrc = fmt.decode_preamble(data[:fmt.PREAMBLE_SIZE], 10_000, "x")
    h = fmt.decode_header(data[fmt.PREAMBLE_SIZE:], header_crc=hcrc, byte_order=order, minor=minor, file_size=10_000,
                          path="x")
    assert h.entries == (e, b)


@pytest.mark.parametrize("bad", [None, [], "stream.zstd/1", [1], ["x" * 300]])
def test_hostile_transform_lists_in_a_shard_header_are_refused(bad):
    e = fmt.Entry("w", None, fmt.KIND_ENCODED, None, (), 4096, 5, 1, ("a/1",)).to_json()
    e["transforms"] = bad
    import json
    body = json.dumps({"format": "mmapckpt", "entries": [e]}).encode()
    import zlib
    with pytest.raises(mmapckpt.FormatError, match="transforms"):
        fmt.decode_header(body, header_crc=zlib.crc32(body), byte_order=fmt.host_byte_order(), minor=0,
                          file_size=10_000, path="x")


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(sd=tensor_state_dicts())
def test_any_state_dict_round_trips_bitwise_through_a_transform(tmp_path_factory, sd):
    path = tmp_path_factory.mktemp("t")
    dcp_save(sd, mmapckpt.MmapWriter(path, _extensions=[Invert()]))
    stock = tmp_path_factory.mktemp("s")
    dcp_save(sd, FileSystemWriter(stock, _extensions=[Invert()]))
    ours = dcp_load(fresh_like(sd, 0xA5), mmapckpt.MmapReader(path, _extension_registry=invert_registry()))
    assert_tree_equal(ours, sd)
    stock_reader = FileSystemReader(stock, _extension_registry=invert_registry())
    assert_tree_equal(ours, dcp_load(fresh_like(sd, 0xA5), stock_reader))
