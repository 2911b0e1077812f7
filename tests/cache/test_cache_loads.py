"""The local cache of remote checkpoints (storage/cache/) against the real radosgw: round trips bitwise through
every entry point and format, later loads served from mapped copies with no GET, and a remote that changed or
went away never served from the cache."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from s3_data import GetCounter, assert_same, state_dict

import mmapckpt
from mmapckpt.errors import CheckpointError
from mmapckpt.storage.cache import CachedStorage
from mmapckpt.storage.location import storage_for

FORMATS = ("mmapckpt", "dcp", "safetensors", "torch")


def _sd(salt: int) -> dict[str, torch.Tensor]:
    return {k: v for k, v in state_dict(salt=salt).items() if v.numel()}


def _cached_files(cache: str) -> dict[str, int]:
    out = {}
    for d, _, names in os.walk(cache):
        for n in names:
            if not n.startswith("#"):
                out[os.path.join(d, n)] = os.stat(os.path.join(d, n)).st_ino
    return out


def each_byte_once(counter: GetCounter, client, bucket: str) -> int:
    """Assert the GETs counted asked for every byte of every object they touched exactly once (a range past a
    small object's end clipped to it); the bytes of those objects."""
    by_key: dict[str, list[tuple[int, int]]] = {}
    for key, a, b in counter.ranges:
        by_key.setdefault(key, []).append((a, b))
    total = 0
    for key, ranges in by_key.items():
        size = client.head_object(Bucket=bucket, Key=key)["ContentLength"]
        pos = 0
        for a, b in sorted(ranges):
            assert a == pos, f"{key}: bytes from {pos} asked for {'twice' if a < pos else 'never'}"
            pos = min(b, size)
        assert pos == size, f"{key}: {pos} of {size} bytes fetched"
        total += size
    return total


def test_every_entry_point_round_trips_and_a_warm_load_fetches_nothing(env, bucket, cache, s3_server):
    sd = _sd(1)
    url = f"s3://{bucket}/ck"
    mmapckpt.save(sd, url)
    opts = {"cache_dir": cache}
    with GetCounter() as first:
        assert_same(mmapckpt.load(url, storage_options=opts), sd, "first load: ")
    cached = sum(os.path.getsize(p) for p in _cached_files(cache))
    assert each_byte_once(first, s3_server.client(), bucket) == cached  # each byte fetched once, into the cache

    with GetCounter() as warm:
        assert_same(mmapckpt.load(url, storage_options=opts), sd, "load: ")
        targets = {k: torch.zeros_like(v) for k, v in sd.items()}
        mmapckpt.load_into(targets, url, storage_options=opts)
        assert_same(targets, sd, "load_into: ")
        with mmapckpt.open(url, storage_options=opts) as f:
            assert_same({k: f.get_tensor(k) for k in f.keys()}, sd, "open: ")
        targets = {k: torch.zeros_like(v) for k, v in sd.items()}
        dcp.load(targets, storage_reader=mmapckpt.MmapReader(url, storage_options=opts), no_dist=True)
        assert_same(targets, sd, "dcp.load: ")
        model = torch.nn.Module()
        model.proj = torch.nn.Parameter(torch.zeros_like(sd["proj"]))
        mmapckpt.load_model(model, url, storage_options=opts, strict=False)
        assert_same(dict(model.state_dict()), {"proj": sd["proj"]}, "load_model: ")
    assert warm.requests == 0 and warm.bytes == 0  # HEADs only: the copies served

    storage = storage_for(url, options=opts)
    assert isinstance(storage, CachedStorage) and storage.can_map
    with storage.open_file(storage.find_metadata()) as f:
        assert f.mapping is not None and f.path.startswith(cache)


def test_the_environment_turns_it_on_and_none_turns_it_off(env, bucket, cache, monkeypatch):
    url = f"s3://{bucket}/ck"
    mmapckpt.save(_sd(2), url)
    monkeypatch.setenv("MMAPCKPT_CACHE_DIR", cache)
    assert isinstance(storage_for(url), CachedStorage)
    assert not isinstance(storage_for(url, options={"cache_dir": None}), CachedStorage)
    monkeypatch.delenv("MMAPCKPT_CACHE_DIR")
    assert not isinstance(storage_for(url), CachedStorage)
    with pytest.raises(CheckpointError, match="cache_max_bytes"):
        storage_for(url, options={"cache_dir": cache, "cache_max_bytes": "lots"})


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_at_a_url(env, bucket, cache, tmp_path, fmt):
    sd = _sd(3)
    local = tmp_path / "local"
    mmapckpt.save(sd, local)
    url = f"s3://{bucket}/f-{fmt}" + (".safetensors" if fmt == "safetensors" else ".pt" if fmt == "torch" else "")
    mmapckpt.convert(local, url, to=fmt)
    opts = {"cache_dir": cache}
    assert_same(mmapckpt.load(url, storage_options=opts), sd, f"{fmt} first: ")
    with GetCounter() as warm:
        assert_same(mmapckpt.load(url, storage_options=opts), sd, f"{fmt} warm: ")
        if fmt in ("mmapckpt", "dcp"):
            targets = {k: torch.zeros_like(v) for k, v in sd.items()}
            dcp.load(targets, storage_reader=mmapckpt.MmapReader(url, storage_options=opts), no_dist=True)
            assert_same(targets, sd, f"{fmt} dcp.load: ")
    assert warm.bytes == 0


def test_a_hugging_face_directory(env, bucket, cache, s3_server, tmp_path):
    sd = _sd(4)
    hf = tmp_path / "hf"
    mmapckpt.save(sd, tmp_path / "local")
    mmapckpt.convert(tmp_path / "local", hf, to="safetensors", max_shard_size=4 << 20)
    client = s3_server.client()
    for name in os.listdir(hf):
        client.upload_file(str(hf / name), bucket, f"m/{name}")
    url, opts = f"s3://{bucket}/m", {"cache_dir": cache}
    for _ in range(2):
        targets = {k: torch.zeros_like(v) for k, v in sd.items()}
        dcp.load(targets, storage_reader=mmapckpt.MmapReader(url, storage_options=opts), no_dist=True)
        assert_same(targets, sd, "dcp.load: ")
        assert_same(mmapckpt.load(url, storage_options=opts), sd, "load: ")


def test_a_changed_remote_is_fetched_again_and_a_deleted_one_never_served(env, bucket, cache, s3_server, tmp_path):
    opts = {"cache_dir": cache}
    url = f"s3://{bucket}/ck"
    mmapckpt.save(_sd(5), url)
    assert_same(mmapckpt.load(url, storage_options=opts), _sd(5), "first: ")
    mmapckpt.save(_sd(6), url)  # a new save over it: new .metadata, new shard
    assert_same(mmapckpt.load(url, storage_options=opts), _sd(6), "after the overwrite: ")

    # one file overwritten in place under the same name (a safetensors file re-uploaded)
    one = f"s3://{bucket}/one.safetensors"
    for salt in (7, 8):
        local = tmp_path / f"l{salt}"
        mmapckpt.save(_sd(salt), local)
        mmapckpt.convert(local, tmp_path / f"s{salt}.safetensors", to="safetensors")
    client = s3_server.client()
    client.upload_file(str(tmp_path / "s7.safetensors"), bucket, "one.safetensors")
    assert_same(mmapckpt.load(one, storage_options=opts), _sd(7), "safetensors first: ")
    client.upload_file(str(tmp_path / "s8.safetensors"), bucket, "one.safetensors")
    assert_same(mmapckpt.load(one, storage_options=opts), _sd(8), "safetensors overwritten: ")

    client.delete_object(Bucket=bucket, Key="one.safetensors")
    with pytest.raises(CheckpointError):
        mmapckpt.load(one, storage_options=opts)
    for o in client.list_objects_v2(Bucket=bucket, Prefix="ck/").get("Contents", ()):
        client.delete_object(Bucket=bucket, Key=o["Key"])
    with pytest.raises(CheckpointError):
        mmapckpt.load(url, storage_options=opts)


def test_convert_inspect_and_verify_read_through_it(env, bucket, cache, tmp_path):
    sd, url, opts = _sd(9), f"s3://{bucket}/ck", {"cache_dir": cache}
    mmapckpt.save(sd, url)
    mmapckpt.convert(url, tmp_path / "out.safetensors", to="safetensors", storage_options=opts)
    assert_same(mmapckpt.load(tmp_path / "out.safetensors"), sd, "converted: ")
    with GetCounter() as warm:
        info = mmapckpt.inspect_checkpoint(url, storage_options=opts)
        report = mmapckpt.verify_checkpoint(url, storage_options=opts)
    assert report.ok, report
    assert info.format == "mmapckpt" and info.files == 1
    assert warm.bytes == 0  # both read the copies the conversion fetched
