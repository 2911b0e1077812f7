"""``convert`` keeps user metadata in every direction that can hold it.

safetensors ``__metadata__`` <-> mmapckpt ``user_metadata``, Hugging Face shards (each
file's header; the index keeps ``total_size`` only); stock DCP and torch.save cannot hold
it: the data is converted and a ConversionWarning says the metadata was dropped. Read back
with the real safetensors library and mmapckpt's own reader.
"""

from __future__ import annotations

import json
import os
import struct
import warnings
import zlib

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import assert_bitwise_equal
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint import FileSystemReader

import mmapckpt
from mmapckpt import ConversionWarning, FormatError, convert
from mmapckpt.format import metadata as mf
from mmapckpt.storage.commits import read_user_metadata_file
from mmapckpt.tools.cli import main

USER = {"author": "me", "step": "1200", "config": json.dumps({"lr": 3e-4, "name": "ünïcode"})}


def _sd() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"a.weight": torch.randn(16, 8, generator=g), "a.bias": torch.randn(8, generator=g).to(torch.bfloat16),
            "b.weight": torch.randint(0, 100, (4, 4), generator=g, dtype=torch.int64)}


def _user(path) -> dict[str, str] | None:
    return read_user_metadata_file(os.path.join(path, ".metadata"))


def _st_meta(path) -> dict[str, str] | None:
    with safe_open(str(path), framework="pt") as f:
        return f.metadata()


def _same(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for k, v in want.items():
        assert_bitwise_equal(got[k], v, k)


def test_safetensors_to_mmapckpt_and_back_keeps_the_header_metadata_exactly(tmp_path) -> None:
    sd = _sd()
    save_file(sd, tmp_path / "in.safetensors", metadata=USER)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        convert(tmp_path / "in.safetensors", tmp_path / "mm", to="mmapckpt")
        convert(tmp_path / "mm", tmp_path / "out.safetensors", to="safetensors")
    assert _user(tmp_path / "mm") == USER
    _same(mmapckpt.load(tmp_path / "mm"), sd)
    # the output carries "format": "pt" as save_pretrained writes it, then the user's keys
    assert _st_meta(tmp_path / "out.safetensors") == {"format": "pt", **USER}
    _same(load_file(tmp_path / "out.safetensors"), sd)
    # and a file that had the marker round-trips byte for byte in its metadata
    save_file(sd, tmp_path / "pt.safetensors", metadata={"format": "pt", **USER})
    convert(tmp_path / "pt.safetensors", tmp_path / "mm2", to="mmapckpt")
    convert(tmp_path / "mm2", tmp_path / "pt2.safetensors", to="safetensors")
    assert _st_meta(tmp_path / "pt2.safetensors") == {"format": "pt", **USER}


def test_mmapckpt_metadata_goes_into_the_safetensors_header(tmp_path) -> None:
    sd = _sd()
    mmapckpt.save(sd, tmp_path / "c", metadata=USER)
    convert(tmp_path / "c", tmp_path / "m.safetensors", to="safetensors")
    assert _st_meta(tmp_path / "m.safetensors") == {"format": "pt", **USER}
    _same(load_file(tmp_path / "m.safetensors"), sd)
    # into a directory, as Hugging Face names one file
    os.makedirs(tmp_path / "hf")
    convert(tmp_path / "c", tmp_path / "hf", to="safetensors", overwrite=True)
    assert _st_meta(tmp_path / "hf" / "model.safetensors") == {"format": "pt", **USER}


def test_a_user_format_key_wins(tmp_path) -> None:
    mmapckpt.save(_sd(), tmp_path / "c", metadata={"format": "np", "x": "1"})
    convert(tmp_path / "c", tmp_path / "m.safetensors", to="safetensors")
    assert _st_meta(tmp_path / "m.safetensors") == {"format": "np", "x": "1"}


def test_sharded_output_has_the_metadata_in_every_shard_and_the_right_total_size(tmp_path) -> None:
    sd = _sd()
    mmapckpt.save(sd, tmp_path / "c", metadata=USER)
    convert(tmp_path / "c", tmp_path / "hf", to="safetensors", max_shard_size=600)
    with open(tmp_path / "hf" / "model.safetensors.index.json") as f:
        index = json.load(f)
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 2
    for name in shards:
        assert _st_meta(tmp_path / "hf" / name) == {"format": "pt", **USER}
    # the index's "metadata" is what Hugging Face writes there: total_size, the bytes of all tensors
    assert index["metadata"] == {"total_size": sum(t.numel() * t.element_size() for t in sd.values())}
    # and a sharded source gives its metadata back
    convert(tmp_path / "hf", tmp_path / "back", to="mmapckpt")
    assert _user(tmp_path / "back") == {"format": "pt", **USER}
    _same(mmapckpt.load(tmp_path / "back"), sd)


def test_mmapckpt_to_mmapckpt_keeps_it(tmp_path) -> None:
    mmapckpt.save(_sd(), tmp_path / "c", metadata=USER)
    convert(tmp_path / "c", tmp_path / "d", to="mmapckpt")
    assert _user(tmp_path / "d") == USER


@pytest.mark.parametrize("to", ["dcp", "torch"])
def test_targets_that_cannot_hold_it_keep_the_data_and_warn(tmp_path, to) -> None:
    sd = _sd()
    mmapckpt.save(sd, tmp_path / "c", metadata=USER)
    out = tmp_path / ("o" if to == "dcp" else "o.pt")
    with pytest.warns(ConversionWarning, match=r"user metadata \(author, config, step\) was dropped"):
        convert(tmp_path / "c", out, to=to)
    if to == "torch":
        _same(torch.load(out, weights_only=True), sd)
    else:
        targets = {k: torch.zeros_like(v) for k, v in sd.items()}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(targets, storage_reader=FileSystemReader(out), no_dist=True)
        _same(targets, sd)


@pytest.mark.parametrize("meta", [None, {"format": "pt"}])
def test_no_warning_when_there_is_nothing_to_drop(tmp_path, meta) -> None:
    save_file(_sd(), tmp_path / "in.safetensors", metadata=meta)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        convert(tmp_path / "in.safetensors", tmp_path / "o", to="dcp")
        convert(tmp_path / "in.safetensors", tmp_path / "o.pt", to="torch")
        convert(tmp_path / "in.safetensors", tmp_path / "mm", to="mmapckpt")
    assert _user(tmp_path / "mm") == meta


def test_a_hostile_user_metadata_stops_the_conversion(tmp_path) -> None:
    mmapckpt.save(_sd(), tmp_path / "c", metadata=USER)
    meta = os.path.join(tmp_path / "c", ".metadata")
    with open(meta, "rb") as f:
        data = f.read()
    doc = json.loads(data[24:])
    doc["user_metadata"] = {"a": 1}
    body = json.dumps(doc).encode()
    major, minor = struct.unpack_from("<8sHH", data)[1:]
    with open(meta, "wb") as f:
        f.write(struct.pack("<8sHHIQ", mf.META_MAGIC, major, minor, zlib.crc32(body), len(body)) + body)
    with pytest.raises(FormatError, match="user_metadata") as ei:
        convert(tmp_path / "c", tmp_path / "o.safetensors", to="safetensors")
    assert ei.value.path == meta
    assert not os.path.exists(tmp_path / "o.safetensors")


def test_the_cli_keeps_it_too(tmp_path, capsys) -> None:
    save_file(_sd(), tmp_path / "in.safetensors", metadata=USER)
    assert main(["convert", str(tmp_path / "in.safetensors"), str(tmp_path / "mm"), "--to", "mmapckpt", "-q"]) == 0
    assert _user(tmp_path / "mm") == USER
    assert main(["convert", str(tmp_path / "mm"), str(tmp_path / "o.pt"), "--to", "torch", "-q"]) == 0
    assert "user metadata (author, config, step) was dropped" in capsys.readouterr().err
