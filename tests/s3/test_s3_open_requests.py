"""What opening a committed checkpoint at ``s3://`` asks the store, and how the client reads the answers.

Opening a committed checkpoint asks whether the prefix holds anything (one listing of one key) and GETs its
commit's and its shards' first bytes; the commit is looked up by name, not in a full listing of the prefix (two
requests on S3, its objects and its uploads in progress: ``load_into`` and ``load`` paid three listings before
their first data GET, ``dcp.load`` with MmapReader none). A Hugging Face directory, which has no commit, is still
listed and loads. Every response is read with immediate acknowledgements (``TCP_QUICKACK``, storage/s3/quick_acks.py):
a small response from radosgw otherwise waits 40 ms for the client's delayed acknowledgement."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed.checkpoint as dcp
from s3_data import assert_same, s3_operations, state_dict

import mmapckpt
from mmapckpt.reading.locate import detect_format
from mmapckpt.storage.s3.options import S3Options, client_for


def _sd() -> dict[str, torch.Tensor]:
    return {k: v for k, v in state_dict(salt=5).items() if v.numel()}


def _into(url: str) -> dict[str, torch.Tensor]:
    targets = {k: torch.zeros_like(v) for k, v in _sd().items()}
    mmapckpt.load_into(targets, url)
    return targets


def _dcp(url: str) -> dict[str, torch.Tensor]:
    targets = {k: torch.zeros_like(v) for k, v in _sd().items()}
    dcp.load(targets, storage_reader=mmapckpt.MmapReader(url), no_dist=True)
    return targets


@pytest.mark.parametrize("fmt", ["mmapckpt", "dcp"])
@pytest.mark.parametrize("entry", ["load", "load_into", "dcp.load", "open"])
def test_opening_a_committed_checkpoint_lists_nothing(s3_env, s3_bucket, tmp_path, fmt, entry):
    url = f"s3://{s3_bucket}/ck-{fmt}"
    if fmt == "mmapckpt":
        mmapckpt.save(_sd(), url)
    else:
        mmapckpt.save(_sd(), tmp_path / "local")
        mmapckpt.convert(tmp_path / "local", url, to="dcp")
    with s3_operations() as ops:
        if entry == "open":
            with mmapckpt.open(url) as ckpt:
                got = {k: ckpt.get_tensor(k) for k in ckpt.keys()}
        else:
            got = {"load": mmapckpt.load, "load_into": _into, "dcp.load": _dcp}[entry](url)
        assert_same(got, _sd(), f"{fmt} through {entry}: ")
    assert "GetObject" in ops, ops
    # dcp.load names a directory (MmapReader); the other entry points ask whether the URL is one (one key listed)
    assert [o for o in ops if o != "GetObject"] == ([] if entry == "dcp.load" else ["ListObjectsV2"]), ops


def test_a_prefix_without_a_commit_is_still_listed(s3_env, s3_bucket, tmp_path):
    """A Hugging Face directory (no ``.metadata``): the lookup of a commit finds none, the listing finds the files."""
    sd = _sd()
    local = tmp_path / "hf"
    local.mkdir()
    mmapckpt.save(sd, tmp_path / "src")
    mmapckpt.convert(tmp_path / "src", local / "model.safetensors", to="safetensors")
    url = f"s3://{s3_bucket}/hf"
    client = client_for(S3Options.of(None))
    client.upload_file(str(local / "model.safetensors"), s3_bucket, "hf/model.safetensors")
    with s3_operations() as ops:
        assert detect_format(url) == "safetensors"
        assert_same(mmapckpt.load(url), sd, "hf at the store: ")
    assert "ListObjectsV2" in ops, ops
    with pytest.raises(mmapckpt.CheckpointNotFoundError):
        mmapckpt.load(f"s3://{s3_bucket}/nothing-here")


@pytest.mark.skipif(not hasattr(socket, "TCP_QUICKACK"), reason="TCP_QUICKACK is Linux's")
def test_every_response_is_read_with_quick_acknowledgements(s3_env, s3_bucket, monkeypatch):
    url = f"s3://{s3_bucket}/qa"
    mmapckpt.save(_sd(), url)
    set_on: list[int] = []
    setsockopt = socket.socket.setsockopt

    def spy(self: socket.socket, level: int, option: int, *value: object) -> None:
        if (level, option, value[:1]) == (socket.IPPROTO_TCP, socket.TCP_QUICKACK, (1,)):
            set_on.append(self.fileno())
        setsockopt(self, level, option, *value)  # type: ignore[arg-type]
    monkeypatch.setattr(socket.socket, "setsockopt", spy)
    with s3_operations() as ops:
        assert_same(mmapckpt.load(url), _sd(), "load: ")
    assert len(ops) >= 3 and len(set_on) == len(ops), (ops, set_on)  # one per response
