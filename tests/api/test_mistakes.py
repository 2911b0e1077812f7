"""The usual mistakes with the single-process API get a message that says what to do."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import helpers
import mmapckpt


@pytest.fixture
def ckpt(tmp_path):
    sd = {"w": torch.tensor([1.75, -2.5, 3.25]), "z": torch.tensor([1 + 2j], dtype=torch.complex64),
          "i": torch.arange(3, dtype=torch.int64)}
    mmapckpt.save(sd, tmp_path / "c")
    return sd, tmp_path / "c"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message where CUDA is missing")
def test_load_to_an_unavailable_device_says_so_before_any_work(ckpt):
    _, path = ckpt
    with pytest.raises(RuntimeError, match="device 'cuda' is not available in this process"):
        mmapckpt.load(path, device="cuda")


def test_load_into_meta_tensors_is_refused_and_points_to_assign(ckpt):
    _, path = ckpt
    with torch.device("meta"):
        targets = {"w": torch.empty(3)}
    with pytest.raises(ValueError, match=r"'w' .*meta device.*assign=True"):
        mmapckpt.load_into(targets, path)


@pytest.mark.parametrize("name, dtype", [("w", torch.int32), ("w", torch.bool), ("z", torch.float32),
                                         ("z", torch.int64)])
def test_load_into_refuses_casts_that_lose_the_values(ckpt, name, dtype):
    sd, path = ckpt
    target = torch.zeros(sd[name].shape, dtype=dtype)
    with pytest.raises(TypeError, match=rf"entry '{name}'.*allow_cast=True"):
        mmapckpt.load_into({name: target}, path)
    assert not target.view(torch.uint8).any()  # nothing was written
    mmapckpt.load_into({name: target}, path, allow_cast=True)
    helpers.assert_bitwise_equal(target, torch.zeros_like(target).copy_(sd[name]))


@pytest.mark.parametrize("name, dtype", [("w", torch.float64), ("w", torch.bfloat16), ("i", torch.float32),
                                         ("z", torch.complex128)])
def test_load_into_keeps_casts_that_keep_the_kind_of_value(ckpt, name, dtype):
    sd, path = ckpt
    target = torch.zeros(sd[name].shape, dtype=dtype)
    mmapckpt.load_into({name: target}, path)
    helpers.assert_bitwise_equal(target, torch.zeros_like(target).copy_(sd[name]))


@pytest.mark.parametrize("call", [
    lambda: mmapckpt.save({"w": torch.ones(1)}, "hdfs://bucket/ckpt"),
    lambda: mmapckpt.MmapWriter("hdfs://bucket/ckpt"),
    lambda: mmapckpt.open("hdfs://bucket/ckpt"),
    lambda: mmapckpt.load("hdfs://bucket/ckpt"),
    lambda: mmapckpt.load_into({"w": torch.ones(1)}, "hdfs://bucket/ckpt"),
    lambda: mmapckpt.MmapReader("hdfs://bucket/ckpt").read_metadata(),
    lambda: mmapckpt.convert("hdfs://bucket/ckpt", "out", to="safetensors"),
])
def test_a_url_is_refused_with_what_to_do(tmp_path, monkeypatch, call):
    """A URL of a scheme no storage serves (s3://, az:// and gs:// are served: tests/s3, tests/azure, tests/gcs) is refused, never made a directory."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(mmapckpt.CheckpointError, match="is a URL of a scheme no storage serves: .*s3://"):
        call()
    assert not (tmp_path / "s3:").exists() and not (tmp_path / "hdfs:").exists()


def test_s3_without_the_extra_says_which_extra_to_install(tmp_path):
    """``import mmapckpt`` never imports boto3; an s3:// path without it names the extra."""
    code = ("import sys; sys.modules['boto3'] = None; import mmapckpt\n"
            "assert 'boto3' not in [m for m in sys.modules if sys.modules[m] is not None]\n"
            "try:\n    mmapckpt.load('s3://bucket/ckpt')\n"
            "except mmapckpt.CheckpointError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "pip install 'mmapckpt[s3]'" in out.stdout, out.stdout + out.stderr


def test_open_and_load_verify_checksums_when_asked(tmp_path):
    path = tmp_path / "c"
    w = torch.arange(1000, dtype=torch.float32)
    mmapckpt.save({"w": w, "b": torch.ones(3)}, path)
    shard = next(p for p in path.iterdir() if p.name.endswith(".distcp"))
    with mmapckpt.open(path) as f:
        off = f.metadata("w").chunks[0].file_offset
    raw = bytearray(shard.read_bytes())
    raw[off + 17] ^= 0x04  # one flipped bit inside w
    shard.write_bytes(bytes(raw))
    assert not torch.equal(mmapckpt.load(path)["w"], w)  # by design: returned as it is
    with pytest.raises(mmapckpt.ChecksumError, match="'w@\\[0\\]'"):
        mmapckpt.load(path, verify=True)
    with mmapckpt.open(path, verify=True) as f:
        helpers.assert_bitwise_equal(f.get_tensor("b"), torch.ones(3))  # an intact entry still loads
        with pytest.raises(mmapckpt.ChecksumError):
            f.get_tensor("w")
