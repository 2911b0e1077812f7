"""Every format and the command line at ``s3://`` on the real radosgw.

``convert`` from and to the store for each format pair gives the same tensors, bit for bit, as a
local conversion; a Hugging Face model directory (sharded safetensors with its index) uploaded
as objects opens, loads and fills targets; ``inspect``, ``verify`` and ``convert`` run on URLs
from the command line, and ``verify`` catches a flipped bit in an object.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from s3_data import assert_same, raw, state_dict

import mmapckpt
from mmapckpt.tools.cli import main

FORMATS = ("mmapckpt", "dcp", "safetensors", "torch")


def _src(tmp_path, fmt: str, sd) -> str:
    local = tmp_path / "local"
    if not local.exists():
        mmapckpt.save(sd, local)
    out = tmp_path / f"src-{fmt}"
    if not out.exists():
        mmapckpt.convert(local, out, to=fmt)
    return str(out)


@pytest.mark.parametrize("fmt", FORMATS)
def test_convert_to_and_from_the_store(s3_env, s3_bucket, tmp_path, fmt):
    sd = {k: v for k, v in state_dict(salt=3).items() if k != "empty"}  # torch.save keeps empties; safetensors too
    url = f"s3://{s3_bucket}/conv-{fmt}"
    mmapckpt.convert(_src(tmp_path, "mmapckpt", sd), url, to=fmt)
    assert_same(mmapckpt.load(url), sd, f"{fmt} at the store: ")
    for back in FORMATS:
        out = tmp_path / f"back-{fmt}-{back}"
        mmapckpt.convert(url, out, to=back)
        assert_same(mmapckpt.load(out), sd, f"{fmt} -> {back}: ")


def test_a_hugging_face_directory_on_the_store(s3_env, s3_bucket, s3_server, tmp_path):
    sd = {k: v for k, v in state_dict(salt=8).items() if v.numel()}
    hf = tmp_path / "hf"
    mmapckpt.convert(_src(tmp_path, "mmapckpt", sd), hf, to="safetensors", max_shard_size=4 << 20)
    files = sorted(os.listdir(hf))
    assert "model.safetensors.index.json" in files and len(files) > 2
    (hf / "config.json").write_text(json.dumps({"model_type": "test"}))
    client = s3_server.client()
    for name in os.listdir(hf):
        client.upload_file(str(hf / name), s3_bucket, f"models/m/{name}")
    url = f"s3://{s3_bucket}/models/m"
    assert_same(mmapckpt.load(url), sd, "load: ")
    targets = {k: torch.zeros_like(v) for k, v in sd.items()}
    mmapckpt.load_into(targets, url)
    assert_same(targets, sd, "load_into: ")
    with mmapckpt.open(url) as f:
        assert raw(f.get_slice("proj")[2:4]) == raw(sd["proj"][2:4])


def test_the_command_line_on_urls(s3_env, s3_bucket, s3_server, tmp_path, capsys):
    sd = state_dict(salt=1)
    url = f"s3://{s3_bucket}/cli"
    mmapckpt.save(sd, url)
    assert main(["inspect", url]) == 0
    assert "big" in capsys.readouterr().out
    assert main(["verify", url]) == 0
    assert main(["convert", url, f"s3://{s3_bucket}/cli-st", "--to", "safetensors", "-q"]) == 0
    assert_same(mmapckpt.load(f"s3://{s3_bucket}/cli-st"), {k: v for k, v in sd.items()}, "cli convert: ")
    # a flipped bit in the shard object: verify names the entry
    client = s3_server.client()
    key = next(o["Key"] for o in client.list_objects_v2(Bucket=s3_bucket, Prefix="cli/")["Contents"]
               if o["Key"].endswith(".distcp"))
    with mmapckpt.open(url) as f:
        at = f.info("big").chunks[0].file_offset
    data = bytearray(client.get_object(Bucket=s3_bucket, Key=key)["Body"].read())
    data[at + 12345] ^= 1
    client.put_object(Bucket=s3_bucket, Key=key, Body=bytes(data))
    capsys.readouterr()
    assert main(["verify", url]) != 0
    assert "big" in capsys.readouterr().out
