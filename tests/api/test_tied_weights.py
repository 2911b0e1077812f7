"""Tied weights: two names that are one tensor are stored once and loaded as one tensor again.

An exact alias (same storage, offset, shape, strides, dtype) has one shard header entry per
name at the same bytes, and one storage record per name, so DCP readers load both names;
``mmapckpt.load`` returns the same tensor object for both. Views that only overlap are
stored as their own values (docs/format.md 2.6).
"""

from __future__ import annotations

import json
import os
import struct
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import assert_bitwise_equal
from safetensors import safe_open
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemReader

import mmapckpt
from mmapckpt import EntryBoundsError, MmapReader
from mmapckpt.format.aliases import exact_aliases


class Tied(torch.nn.Module):
    def __init__(self, vocab: int = 64, dim: int = 32, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim, dtype=dtype)
        self.norm = torch.nn.LayerNorm(dim, dtype=dtype)
        self.lm_head = torch.nn.Linear(dim, vocab, bias=False, dtype=dtype)
        self.lm_head.weight = self.embed.weight  # tied


def _header(path: str) -> list[dict]:
    with open(path, "rb") as f:
        pre = f.read(32)
        n = struct.unpack("<8sHHB3xQI4x", pre)[4]
        return json.loads(f.read(n))["entries"]


def _shard(ckpt: str) -> str:
    return os.path.join(ckpt, "__0_0.distcp")


def _quiet_dcp_load(sd: dict, reader) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming the intent is to load in a single process"
        dcp.load(sd, storage_reader=reader, no_dist=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_tied_weights_are_stored_once_and_loaded_as_one_tensor(tmp_path, dtype) -> None:
    model = Tied(dtype=torch.float32)
    sd = {k: v.detach().to(dtype) if dtype != torch.float32 else v.detach() for k, v in model.state_dict().items()}
    if dtype != torch.float32:
        sd["lm_head.weight"] = sd["embed.weight"]  # .to() made two tensors: tie them again
    raw = sd["embed.weight"].view(torch.uint8).reshape(-1)
    raw[:4] = torch.tensor([0x7F, 0xFF, 0x80, 0x00], dtype=torch.uint8)  # NaN payload / -0.0 bytes kept
    assert exact_aliases(sd) == {"lm_head.weight": "embed.weight"}
    mmapckpt.save(sd, tmp_path / "c")
    entries = {e["fqn"]: e for e in _header(_shard(str(tmp_path / "c")))}
    emb, head = entries["embed.weight"], entries["lm_head.weight"]
    assert (emb["offset"], emb["length"], emb["crc32"]) == (head["offset"], head["length"], head["crc32"])
    # the bytes are in the file once: no other entry lies in the alias's region
    others = [e for k, e in entries.items() if k not in ("embed.weight", "lm_head.weight")]
    assert all(e["offset"] + e["length"] <= emb["offset"] or e["offset"] >= emb["offset"] + emb["length"]
               for e in others)
    out = mmapckpt.load(tmp_path / "c")
    assert out["lm_head.weight"] is out["embed.weight"]
    for k, v in sd.items():
        assert_bitwise_equal(out[k], v, k)
    assert mmapckpt.load(tmp_path / "c", verify=True)["lm_head.weight"] is not None
    assert mmapckpt.verify_checkpoint(tmp_path / "c").ok


def test_the_file_is_smaller_by_one_copy(tmp_path) -> None:
    w = torch.randn(256, 256)  # 256 KiB
    mmapckpt.save({"a": w, "b": w}, tmp_path / "tied")
    mmapckpt.save({"a": w, "b": w.clone()}, tmp_path / "untied")
    tied, untied = (os.path.getsize(_shard(str(tmp_path / n))) for n in ("tied", "untied"))
    assert untied - tied == w.numel() * 4


def test_dcp_load_into_a_tied_model(tmp_path) -> None:
    src = Tied()
    mmapckpt.save(src.state_dict(), tmp_path / "c")
    dst = Tied()
    with torch.no_grad():
        for p in dst.parameters():
            p.zero_()
    sd = dst.state_dict()
    assert sd["lm_head.weight"].data_ptr() == sd["embed.weight"].data_ptr()
    _quiet_dcp_load(sd, MmapReader(tmp_path / "c"))
    for k, v in src.state_dict().items():
        assert_bitwise_equal(dst.state_dict()[k], v, k)
    assert dst.lm_head.weight is dst.embed.weight  # still tied
    # and into untied targets: both names read
    flat = {k: torch.zeros_like(v) for k, v in src.state_dict().items()}
    _quiet_dcp_load(flat, MmapReader(tmp_path / "c", verify=True))
    for k, v in src.state_dict().items():
        assert_bitwise_equal(flat[k], v, k)


def test_load_into_and_open_read_both_names(tmp_path) -> None:
    src = Tied()
    mmapckpt.save(src.state_dict(), tmp_path / "c")
    dst = Tied()
    mmapckpt.load_into(dst.state_dict(), tmp_path / "c")
    assert_bitwise_equal(dst.lm_head.weight, src.embed.weight)
    with mmapckpt.open(tmp_path / "c") as f:
        a, b = f.get_tensor("embed.weight"), f.get_tensor("lm_head.weight")
        assert a.data_ptr() == b.data_ptr()  # views of the same mapped bytes
        assert_bitwise_equal(f.get_slice("lm_head.weight")[3:5], src.embed.weight[3:5])
    only = mmapckpt.load(tmp_path / "c", keys=["lm_head.weight"])
    assert list(only) == ["lm_head.weight"]
    assert_bitwise_equal(only["lm_head.weight"], src.embed.weight)


def test_a_model_built_on_meta_gets_one_parameter_object_back(tmp_path) -> None:
    mmapckpt.save(Tied().state_dict(), tmp_path / "c")
    sd = mmapckpt.load(tmp_path / "c")
    with torch.device("meta"):
        model = Tied()
    model.load_state_dict(sd, assign=True)
    # assign=True wraps each name in its own Parameter (as with safetensors); the memory is one
    assert model.lm_head.weight.data_ptr() == model.embed.weight.data_ptr()


@pytest.mark.parametrize("name, other", [
    ("transpose", lambda x: x.t()),
    ("row", lambda x: x[1]),
    ("narrow", lambda x: x[:, 1:3]),
    ("reshape-view", lambda x: x.view(-1)),
    ("conj", None),
])
def test_views_that_only_overlap_are_stored_as_their_own_values(tmp_path, name, other) -> None:
    if other is None:
        x = torch.randn(4, 4, dtype=torch.complex64)
        y = x.conj()  # same storage, offset, shape and strides: different values
    else:
        x = torch.randn(4, 4)
        y = other(x)
    assert exact_aliases({"x": x, "y": y}) == {}
    mmapckpt.save({"x": x, "y": y}, tmp_path / "c")
    out = mmapckpt.load(tmp_path / "c")
    assert out["x"] is not out["y"]
    assert_bitwise_equal(out["x"], x)
    assert_bitwise_equal(out["y"], y)


def test_several_aliases_and_a_non_contiguous_one(tmp_path) -> None:
    base = torch.randn(8, 6)
    t = base.t()  # a non-contiguous view, named three times
    sd = {"a": t, "b": base, "c": t, "d": t, "e": torch.empty(0), "f": torch.empty(0)}
    assert exact_aliases(sd) == {"c": "a", "d": "a"}
    mmapckpt.save(sd, tmp_path / "c")
    out = mmapckpt.load(tmp_path / "c")
    assert out["c"] is out["a"] and out["d"] is out["a"]
    assert out["e"] is not out["f"]
    for k, v in sd.items():
        assert_bitwise_equal(out[k], v, k)


def test_aliases_split_over_files_are_each_stored(tmp_path) -> None:
    w = torch.randn(64, 64)
    sd = {"a": w, "b": torch.randn(64, 64), "c": w}
    mmapckpt.save(sd, tmp_path / "c", thread_count=2)
    out = mmapckpt.load(tmp_path / "c")
    for k, v in sd.items():
        assert_bitwise_equal(out[k], v, k)


def test_conversions_of_tied_weights(tmp_path) -> None:
    src = Tied()
    ref = src.state_dict()
    mmapckpt.save(ref, tmp_path / "c")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mmapckpt.convert(tmp_path / "c", tmp_path / "m.safetensors", to="safetensors")
        mmapckpt.convert(tmp_path / "c", tmp_path / "mm", to="mmapckpt")
        mmapckpt.convert(tmp_path / "c", tmp_path / "stock", to="dcp")
    st = load_file(tmp_path / "m.safetensors")  # the real safetensors reader: both names present
    assert set(st) == set(ref)
    for k, v in ref.items():
        assert_bitwise_equal(st[k], v, k)
    with safe_open(tmp_path / "m.safetensors", framework="pt") as f:
        assert set(f.keys()) == set(ref)
    # mmapckpt -> mmapckpt keeps the tie
    entries = {e["fqn"]: e for e in _header(_shard(str(tmp_path / "mm")))}
    assert entries["embed.weight"]["offset"] == entries["lm_head.weight"]["offset"]
    out = mmapckpt.load(tmp_path / "mm")
    assert out["lm_head.weight"] is out["embed.weight"]
    assert mmapckpt.verify_checkpoint(tmp_path / "mm").ok
    # stock DCP: written twice, read by the stock reader
    flat = {k: torch.zeros_like(v) for k, v in ref.items()}
    _quiet_dcp_load(flat, FileSystemReader(tmp_path / "stock"))
    for k, v in ref.items():
        assert_bitwise_equal(flat[k], v, k)


def test_an_alias_whose_checksum_differs_is_refused(tmp_path) -> None:
    """Two entries at the same bytes are an alias only when they describe them identically."""
    w = torch.randn(32)
    mmapckpt.save({"a": w, "b": w}, tmp_path / "c")
    path = _shard(str(tmp_path / "c"))
    with open(path, "rb") as f:
        data = bytearray(f.read())
    magic, major, minor, order, hlen, _crc = struct.unpack("<8sHHB3xQI4x", data[:32])
    doc = json.loads(data[32:32 + hlen])
    doc["entries"][1]["crc32"] = "%08x" % (int(doc["entries"][1]["crc32"], 16) ^ 1)
    body = json.dumps(doc, separators=(",", ":")).encode()
    assert len(body) == hlen
    import zlib
    data[:32 + hlen] = struct.pack("<8sHHB3xQI4x", magic, major, minor, order, hlen, zlib.crc32(body)) + body
    with open(path, "wb") as f:
        f.write(data)
    report = mmapckpt.verify_checkpoint(tmp_path / "c")
    assert not report.ok
    with pytest.raises(EntryBoundsError, match="overlaps"):
        mmapckpt.convert(tmp_path / "c", tmp_path / "o.safetensors", to="safetensors")
