"""Checkpoints at ``s3://BUCKET/PREFIX`` on a real S3 server (Ceph radosgw, tests/s3/conftest.py).

Round trips through ``dcp.save``/``dcp.load`` with MmapWriter/MmapReader, ``mmapckpt.save``,
``load``, ``load_into`` and ``open`` are bitwise (bf16, fp8, NaN payloads, -0.0, empty) and
equal to what DCP's own S3 path (FsspecWriter/FsspecReader over s3fs) stores and loads from
the same input. The objects are the local checkpoint's files byte for byte (a local save
uploaded is a checkpoint, a saved prefix downloaded is a local one). Overwrites never reuse
a committed name and leave only what the new commit references; ``open`` + ``get_slice``
asks the store for the bytes of the slice only (counted at the client).
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from s3_data import SMALL_PARTS, GetCounter, assert_same, complement, raw, state_dict

import mmapckpt
from mmapckpt import CheckpointNotFoundError, MmapReader, MmapWriter

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def _keys(client, bucket: str, prefix: str) -> list[str]:
    out = client.list_objects_v2(Bucket=bucket, Prefix=prefix + "/").get("Contents", [])
    return sorted(o["Key"][len(prefix) + 1:] for o in out)


def _dcp_load(url: str, want: dict[str, torch.Tensor], **reader_options) -> dict[str, torch.Tensor]:
    targets = {n: complement(t) for n, t in want.items()}
    reader = MmapReader(url, **reader_options)
    dcp.load(targets, storage_reader=reader, no_dist=True)
    return targets


def test_dcp_round_trip_matches_the_stock_fsspec_path(s3_env, s3_bucket, s3_server):
    sd = state_dict()
    url, stock = f"s3://{s3_bucket}/mine", f"s3://{s3_bucket}/stock"
    dcp.save(sd, storage_writer=MmapWriter(url, storage_options=SMALL_PARTS), no_dist=True)
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
    dcp.save(sd, storage_writer=FsspecWriter(stock), no_dist=True)
    mine = _dcp_load(url, sd, storage_options=SMALL_PARTS)
    assert_same(mine, sd, "MmapReader: ")
    theirs = {n: complement(t) for n, t in sd.items()}
    dcp.load(theirs, storage_reader=FsspecReader(stock), no_dist=True)
    assert_same(mine, theirs, "MmapReader vs FsspecReader: ")
    # MmapReader reads the stock checkpoint on S3 too, and the same bytes come out
    assert_same(_dcp_load(stock, sd), sd, "MmapReader on the stock checkpoint: ")
    assert _keys(s3_server.client(), s3_bucket, "mine") == [".metadata", "__0_0.distcp"]


def test_reset_and_overwrite_reuse_no_committed_name(s3_env, s3_bucket, s3_server):
    url = f"s3://{s3_bucket}/run/latest"
    assert MmapWriter.validate_checkpoint_id(url) and MmapReader.validate_checkpoint_id(url) is False
    writer = MmapWriter(url, storage_options=SMALL_PARTS)
    names = []
    for step in range(3):
        sd = state_dict(salt=step)
        writer.reset(url)
        dcp.save(sd, checkpoint_id=url, storage_writer=writer, no_dist=True)
        keys = _keys(s3_server.client(), s3_bucket, "run/latest")
        shards = [k for k in keys if k.endswith(".distcp")]
        assert len(shards) == 1 and keys == sorted([".metadata", *shards]), keys  # only what the commit references
        names.append(shards[0])
        assert_same(_dcp_load(url, sd), sd, f"step {step}: ")
        assert MmapReader.validate_checkpoint_id(url)
    assert names[0] != names[1] and names[1] != names[2]
    assert not s3_server.client().list_multipart_uploads(Bucket=s3_bucket).get("Uploads")


def test_save_load_open_load_into(s3_env, s3_bucket):
    sd = state_dict(salt=5)
    url = f"s3://{s3_bucket}/m"
    mmapckpt.save(sd, url, storage_options=SMALL_PARTS)
    assert_same(mmapckpt.load(url), sd, "load: ")
    targets = {n: complement(t) for n, t in sd.items()}
    assert mmapckpt.load_into(targets, url) == []
    assert_same(targets, sd, "load_into: ")
    assert_same(mmapckpt.load(url, verify=True), sd, "load(verify=True): ")
    with mmapckpt.open(url) as ck:
        assert sorted(ck.keys()) == sorted(sd)
        assert raw(ck.get_tensor("emb")) == raw(sd["emb"])


def test_get_slice_fetches_only_the_slice(s3_env, s3_bucket):
    sd = state_dict()
    url = f"s3://{s3_bucket}/sl"
    mmapckpt.save(sd, url)
    with mmapckpt.open(url) as ck, GetCounter() as gets:
        before = gets.bytes
        got = ck.get_slice("big")[1000:1010]
        fetched = gets.bytes - before
    assert raw(got) == raw(sd["big"][1000:1010])
    assert fetched == 40, f"{fetched} bytes asked of the store for a 40-byte slice"


def test_load_into_reads_straight_into_the_targets_in_parallel_parts(s3_env, s3_bucket):
    sd = state_dict()
    url = f"s3://{s3_bucket}/par"
    mmapckpt.save(sd, url)
    targets = {n: complement(t) for n, t in sd.items()}
    options = {"part_size": 1 << 20}
    with GetCounter(options) as gets:
        dcp.load(targets, storage_reader=MmapReader(url, storage_options=options), no_dist=True)
    assert_same(targets, sd)
    data = sum(t.nbytes for t in sd.values())
    big = [r for r in gets.ranges if r[2] - r[1] == 1 << 20]
    assert len(big) >= 12, "the 12 MiB tensor is read in 1 MiB ranged GETs"
    # every stored byte once, plus the metadata and the shard header (and alignment gaps joined in)
    assert data <= gets.bytes <= data + (256 << 10) * len(sd) + (1 << 20), gets.bytes


def test_local_files_uploaded_are_a_checkpoint_and_back(s3_env, s3_bucket, s3_server, tmp_path):
    """``aws s3 sync`` in both directions: the object layout is the local one, byte for byte."""
    sd = state_dict(salt=2)
    local = tmp_path / "local"
    mmapckpt.save(sd, local)
    client = s3_server.client()
    for name in os.listdir(local):
        client.upload_file(str(local / name), s3_bucket, f"up/{name}")
    assert_same(mmapckpt.load(f"s3://{s3_bucket}/up"), sd, "uploaded: ")
    url = f"s3://{s3_bucket}/down"
    dcp.save(sd, storage_writer=MmapWriter(url, storage_options=SMALL_PARTS), no_dist=True)
    down = tmp_path / "down"
    down.mkdir()
    for key in _keys(client, s3_bucket, "down"):
        client.download_file(s3_bucket, f"down/{key}", str(down / key))
    assert mmapckpt.verify_checkpoint(down).ok
    assert_same(mmapckpt.load(down), sd, "downloaded: ")


def test_missing_bucket_and_prefix_name_the_url(s3_env, s3_bucket):
    with pytest.raises(CheckpointNotFoundError, match=f"s3://no-such-bucket-{s3_bucket}/x.*no such bucket"):
        mmapckpt.load(f"s3://no-such-bucket-{s3_bucket}/x")
    with pytest.raises(CheckpointNotFoundError, match=f"s3://{s3_bucket}/nothing-here"):
        mmapckpt.load(f"s3://{s3_bucket}/nothing-here")
    with pytest.raises(mmapckpt.CheckpointWriteError, match="no such bucket"):
        mmapckpt.save({"a": torch.ones(2)}, f"s3://no-such-bucket-{s3_bucket}/x")


def test_wrong_credentials_are_an_access_error_and_storage_options_override_the_environment(
        s3_env, s3_bucket, monkeypatch):
    url = f"s3://{s3_bucket}/cred"
    mmapckpt.save({"a": torch.arange(5)}, url)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret")
    with pytest.raises(mmapckpt.StorageAccessError, match="refused the credentials"):
        mmapckpt.load(url)
    right = {"key": s3_env["AWS_ACCESS_KEY_ID"], "secret": s3_env["AWS_SECRET_ACCESS_KEY"]}
    got = {"a": torch.zeros(5, dtype=torch.int64)}
    dcp.load(got, storage_reader=MmapReader(url, storage_options=right), no_dist=True)
    assert got["a"].tolist() == list(range(5))
    with pytest.raises(mmapckpt.CheckpointError, match="unknown option"):
        MmapReader(url, storage_options={"secrett": "x"}).storage


@pytest.mark.timeout(60)
def test_an_unreachable_endpoint_fails_in_bounded_time(s3_env, monkeypatch):
    import socket
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    with pytest.raises(mmapckpt.StorageUnavailableError, match="unreachable"):
        mmapckpt.load("s3://bucket/x", storage_options={"retries": 1, "connect_timeout": 1})


def test_the_accelerator_pipeline_reads_objects_into_its_staging_buffers(s3_env, s3_bucket, monkeypatch):
    """The staged path of accelerator targets, run on CPU targets: staging buffers filled by ranged GETs."""
    from mmapckpt.io import staging
    sd = state_dict(salt=6)
    url = f"s3://{s3_bucket}/staged"
    mmapckpt.save(sd, url)
    reader = MmapReader(url, staging_bytes=1 << 20, staging_buffers=2)
    reader._stage_cpu_targets = True
    targets = {n: complement(t) for n, t in sd.items()}
    with GetCounter() as gets:
        dcp.load(targets, storage_reader=reader, no_dist=True)
    reader.close()
    assert_same(targets, sd, "dcp.load staged: ")
    data = sum(t.nbytes for t in sd.values())
    assert gets.bytes <= data + (1 << 20), "every byte fetched once (plus the metadata and shard head)"
    monkeypatch.setattr(staging, "STAGE_CPU_TARGETS", True)
    targets = {n: complement(t) for n, t in sd.items()}
    mmapckpt.load_into(targets, url, staging_bytes=1 << 20, staging_buffers=2)
    assert_same(targets, sd, "load_into staged: ")
    assert_same(mmapckpt.load(url, device="cpu"), sd, "load: ")


def test_an_endpoint_and_keys_are_all_it_takes(s3_env, s3_bucket, monkeypatch):
    """A plain http://127.0.0.1:PORT in AWS_ENDPOINT_URL, path-style addressing, no region set."""
    monkeypatch.delenv("AWS_REGION", raising=False)
    monkeypatch.delenv("AWS_DEFAULT_REGION", raising=False)
    url = f"s3://{s3_bucket}/plain"
    sd = {"w": torch.arange(10, dtype=torch.float32)}
    mmapckpt.save(sd, url)
    assert_same(mmapckpt.load(url), sd)


def test_an_object_replaced_or_removed_while_open_is_never_read_mixed(s3_env, s3_bucket, s3_server):
    """Reads are conditional on the ETag the object had when opened: a shard rewritten meanwhile fails
    the read (IncompleteCheckpointError, "load again") instead of mixing its bytes with the old header's."""
    sd = state_dict(salt=7)
    url = f"s3://{s3_bucket}/changing"
    mmapckpt.save(sd, url)
    client = s3_server.client()
    key = next(o["Key"] for o in client.list_objects_v2(Bucket=s3_bucket, Prefix="changing/")["Contents"]
               if o["Key"].endswith(".distcp"))
    data = client.get_object(Bucket=s3_bucket, Key=key)["Body"].read()
    with mmapckpt.open(url) as f:
        client.put_object(Bucket=s3_bucket, Key=key, Body=data[:-1] + bytes([data[-1] ^ 1]))
        with pytest.raises(mmapckpt.IncompleteCheckpointError, match="changed while it was being read.*load again"):
            f.get_tensor("big")
    with mmapckpt.open(url) as f:
        client.delete_object(Bucket=s3_bucket, Key=key)
        with pytest.raises(mmapckpt.IncompleteCheckpointError, match="removed while it was being read"):
            f.get_tensor("big")


def test_no_credentials_at_all_say_where_to_put_them(s3_env, s3_bucket, monkeypatch):
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(mmapckpt.StorageAccessError, match=f"s3://{s3_bucket}/none.*no credentials.*AWS_ACCESS_KEY_ID"):
        mmapckpt.load(f"s3://{s3_bucket}/none")
