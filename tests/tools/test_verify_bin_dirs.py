"""``verify`` on Hugging Face directories of torch.save files (``pytorch_model.bin``, or shards with
``pytorch_model.bin.index.json``), written by huggingface_hub's own ``save_torch_state_dict``: each file is
loaded with weights_only and its zip CRC-32s read, and every name the index puts in a shard must be there."""

from __future__ import annotations

import json
import logging
import os
import zipfile

import pytest
import torch

import mmapckpt
from mmapckpt.tools.cli import main

hub = pytest.importorskip("huggingface_hub")


def _write(out: str, max_shard_size: int) -> str:
    g = torch.Generator().manual_seed(3)
    sd = {f"layers.{i}.weight": torch.randn(64, 64, generator=g) for i in range(4)}
    sd["norm.weight"] = torch.ones(64, dtype=torch.bfloat16)
    os.makedirs(out)
    logging.getLogger("huggingface_hub").setLevel(logging.ERROR)  # its "unsafe serialization" warning
    hub.save_torch_state_dict(sd, out, safe_serialization=False, max_shard_size=max_shard_size)
    return out


def test_a_single_and_a_sharded_bin_directory_verify(tmp_path) -> None:
    single = _write(str(tmp_path / "single"), 10 << 20)
    sharded = _write(str(tmp_path / "sharded"), 20_000)
    assert os.path.exists(os.path.join(single, "pytorch_model.bin"))
    assert os.path.exists(os.path.join(sharded, "pytorch_model.bin.index.json"))
    r1, r2 = mmapckpt.verify_checkpoint(single), mmapckpt.verify_checkpoint(sharded)
    assert r1.ok and r2.ok, (r1.problems, r2.problems)
    shards = [n for n in os.listdir(sharded) if n.endswith(".bin")]
    assert len(shards) >= 2
    for name in shards:  # each shard loaded and its CRC-32s read
        assert any(c.startswith(os.path.join(sharded, name)) and "zip archive" in c for c in r2.checked), r2.checked
    assert main(["verify", sharded]) == 0


def test_a_damaged_shard_and_an_index_naming_a_missing_tensor_are_problems(tmp_path) -> None:
    d = _write(str(tmp_path / "d"), 20_000)
    index = os.path.join(d, "pytorch_model.bin.index.json")
    with open(index) as f:
        doc = json.load(f)
    shard = doc["weight_map"]["layers.0.weight"]
    doc["weight_map"]["layers.9.weight"] = shard  # a tensor the shard does not hold
    with open(index, "w") as f:
        json.dump(doc, f)
    r = mmapckpt.verify_checkpoint(d)
    assert [(p.path, p.entry) for p in r.problems] == [(os.path.join(d, shard), "layers.9.weight")]

    other = doc["weight_map"]["norm.weight"]
    path = os.path.join(d, other)
    with zipfile.ZipFile(path) as z:  # flip one byte inside a tensor's stored member
        info = next(i for i in z.infolist() if "/data/" in i.filename)
    with open(path, "r+b") as f:
        f.seek(info.header_offset + 26)  # the local header's own name and extra lengths (torch pads the extra)
        name_len, extra_len = int.from_bytes(f.read(2), "little"), int.from_bytes(f.read(2), "little")
        f.seek(info.header_offset + 30 + name_len + extra_len + 5)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))
    r = mmapckpt.verify_checkpoint(d)
    assert any(p.path == path and p.entry == info.filename for p in r.problems), r.problems
    assert main(["verify", d]) == 1
