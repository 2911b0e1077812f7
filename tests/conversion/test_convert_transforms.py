"""Checkpoints written through DCP stream transforms convert, verify and inspect like any other."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint._extension import ZStandard

import mmapckpt
from helpers import Invert, assert_bitwise_equal, dcp_save

needs_zstd = pytest.mark.skipif(not ZStandard.is_available(), reason="zstandard is not installed")


def _sd():
    return {"w": torch.randn(40, 3).to(torch.bfloat16), "ids": torch.arange(5000), "step": {"n": 3}}


@needs_zstd
@pytest.mark.parametrize("writer", [mmapckpt.MmapWriter, FileSystemWriter])
def test_a_zstd_checkpoint_converts_bitwise_to_safetensors(tmp_path, writer):
    sd = _sd()
    dcp_save(sd, writer(tmp_path / "c", _extensions=[ZStandard()]))
    with pytest.warns(mmapckpt.ConversionWarning):  # the non-tensor entry has no place in safetensors
        mmapckpt.convert(tmp_path / "c", tmp_path / "m.safetensors", to="safetensors")
    out = load_file(tmp_path / "m.safetensors")
    assert_bitwise_equal(out["w"], sd["w"])
    assert_bitwise_equal(out["ids"], sd["ids"])


@needs_zstd
def test_a_zstd_checkpoint_converts_to_a_raw_one_that_maps(tmp_path):
    sd = _sd()
    dcp_save(sd, mmapckpt.MmapWriter(tmp_path / "c", _extensions=[ZStandard()]))
    mmapckpt.convert(tmp_path / "c", tmp_path / "raw", to="mmapckpt")
    with mmapckpt.open(tmp_path / "raw") as f:
        assert_bitwise_equal(f.get_tensor("ids"), sd["ids"])


def test_verify_checks_and_decodes_encoded_entries(tmp_path):
    dcp_save(_sd(), mmapckpt.MmapWriter(tmp_path, _extensions=[Invert()]))
    report = mmapckpt.verify_checkpoint(tmp_path)
    assert report.ok, [str(p) for p in report.problems]
    # a transform of one's own: the stored bytes are checked, decoding is left to dcp.load with its registry
    assert any("test.invert/1" in n and "not decoded" in n for n in report.notes)


@needs_zstd
def test_verify_finds_an_encoded_entry_that_does_not_decode(tmp_path):
    dcp_save(_sd(), mmapckpt.MmapWriter(tmp_path, _extensions=[ZStandard()]))
    shard = tmp_path / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    md = mmapckpt.MmapReader(tmp_path).read_metadata()
    info = next(v for k, v in md.storage_data.items() if k.fqn == "ids")
    data[info.offset:info.offset + 4] = b"\0\0\0\0"  # the zstd frame magic
    shard.write_bytes(bytes(data))
    import json
    import zlib

    from mmapckpt.format import layout as fmt
    # keep the checksum right, so only decoding can find the damage
    _, _, hlen, _ = fmt.decode_preamble(bytes(data[:32]), len(data), "x")
    doc = json.loads(bytes(data[32:32 + hlen]))
    for e in doc["entries"]:
        if e["fqn"] == "ids":
            e["crc32"] = f"{zlib.crc32(bytes(data[e['offset']:e['offset'] + e['length']])):08x}"
    from helpers import shard_with_header
    shard.write_bytes(shard_with_header(bytes(data), doc))
    report = mmapckpt.verify_checkpoint(tmp_path)
    assert not report.ok
    assert any("ids" in str(p) and "decode" in str(p) for p in report.problems)


@needs_zstd
def test_non_tensor_values_of_a_zstd_checkpoint_convert_decoded(tmp_path):
    sd = _sd()
    dcp_save(sd, mmapckpt.MmapWriter(tmp_path / "c", _extensions=[ZStandard()]))
    mmapckpt.convert(tmp_path / "c", tmp_path / "stock", to="dcp")
    import torch.distributed.checkpoint as dcp

    out = {"w": torch.zeros(40, 3, dtype=torch.bfloat16), "ids": torch.zeros(5000, dtype=torch.int64), "step": {"n": 0}}
    dcp.load(out, checkpoint_id=tmp_path / "stock", no_dist=True)  # the stock reader
    assert out["step"] == {"n": 3}
    assert_bitwise_equal(out["ids"], sd["ids"])
