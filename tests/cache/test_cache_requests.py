"""What a warm load through the cache asks the store (listing.py): one HEAD of an mmapckpt commit, whose version
vouches for the listing recorded with it; a stock DCP commit, or a record of another version, is listed again."""

from __future__ import annotations

import os

import torch
from s3_data import assert_same, s3_operations, state_dict

import mmapckpt
from mmapckpt.storage.cache.listing import LISTING


def _sd(salt: int) -> dict[str, torch.Tensor]:
    return {k: v for k, v in state_dict(salt=salt).items() if v.numel()}


def _records(cache: str) -> list[str]:
    return [os.path.join(d, n) for d, _, names in os.walk(cache) for n in names if n == LISTING]


def test_a_warm_load_asks_one_head_and_a_new_save_is_listed_again(env, bucket, cache):
    url, opts = f"s3://{bucket}/ck", {"cache_dir": cache}
    mmapckpt.save(_sd(1), url)
    with s3_operations() as first:
        assert_same(mmapckpt.load(url, storage_options=opts), _sd(1), "first: ")
    assert "ListObjectsV2" in first and len(_records(cache)) == 1
    for _ in range(2):
        with s3_operations() as warm:
            assert_same(mmapckpt.load(url, storage_options=opts), _sd(1), "warm: ")
            targets = {k: torch.zeros_like(v) for k, v in _sd(1).items()}
            mmapckpt.load_into(targets, url, storage_options=opts)
            assert_same(targets, _sd(1), "warm load_into: ")
        assert warm == ["HeadObject", "HeadObject"], warm  # one per load: the commit's version

    mmapckpt.save(_sd(2), url)  # a new commit (new version), a new shard: the record no longer applies
    with s3_operations() as after:
        assert_same(mmapckpt.load(url, storage_options=opts), _sd(2), "after a new save: ")
    assert "ListObjectsV2" in after and "GetObject" in after
    with s3_operations() as warm:
        assert_same(mmapckpt.load(url, storage_options=opts), _sd(2), "warm after: ")
    assert warm == ["HeadObject"], warm


def test_a_stock_dcp_commit_and_a_damaged_record_are_listed(env, bucket, cache, tmp_path):
    local = tmp_path / "local"
    mmapckpt.save(_sd(3), local)
    dcp_url, url, opts = f"s3://{bucket}/dcp", f"s3://{bucket}/ck", {"cache_dir": cache}
    mmapckpt.convert(local, dcp_url, to="dcp")  # its .metadata is the same for two saves of one model: listed
    for _ in range(2):
        with s3_operations() as ops:
            assert_same(mmapckpt.load(dcp_url, storage_options=opts), _sd(3), "dcp: ")
        assert "ListObjectsV2" in ops
    assert not _records(cache)

    mmapckpt.save(_sd(4), url)
    mmapckpt.load(url, storage_options=opts)
    (record,) = _records(cache)
    with open(record, "r+b") as f:
        f.write(b"[")  # no longer the record (a list)
    with s3_operations() as ops:
        assert_same(mmapckpt.load(url, storage_options=opts), _sd(4), "damaged record: ")
    assert "ListObjectsV2" in ops and "GetObject" not in ops  # listed again; the copies still served
    with s3_operations() as ops:
        mmapckpt.load(url, storage_options=opts)
    assert ops == ["HeadObject"], ops  # recorded again


def test_the_fetch_asks_for_each_window_in_one_request_the_size_a_load_asks_for(env, bucket, cache, monkeypatch):
    """The first load's fetch into the cache reads the shard in windows, each one GET of the size a load without the
    cache asks for (``StoredFile.request_shape``; here capped at 4 MiB windows, with 1 MiB parts over 4 threads:
    a load's requests are 4 MiB). The code before read each window as a batch of its own, cut into 1 MiB parts:
    four times the GETs, each a quarter of a load's (radosgw, 1 GB: 1.96 s against 1.46 s, docs/benchmarks.md)."""
    from s3_data import GetCounter

    from mmapckpt.storage.cache import entry

    monkeypatch.setattr(entry, "_WINDOW", 4 << 20)
    g = torch.Generator().manual_seed(5)
    sd = {f"w{i}": torch.randn(1 << 20, generator=g) for i in range(4)}  # 4 x 4 MiB
    url = f"s3://{bucket}/windows"
    mmapckpt.save(sd, url)
    opts = {"cache_dir": cache, "part_size": 1 << 20, "concurrency": 4}
    with GetCounter({"part_size": 1 << 20, "concurrency": 4}) as gets:
        assert_same(mmapckpt.load(url, storage_options=opts), sd, "first: ")
    bulk = [b - a for key, a, b in gets.ranges if key.endswith("__0_0.distcp") and a >= 64 << 10]
    size = sum(t.nbytes for t in sd.values())
    assert sum(bulk) >= size - (64 << 10) and len(bulk) <= -(-size // (4 << 20)) + 1, bulk
    assert max(bulk) > 2 << 20, bulk  # a window is one request, not cut into 1 MiB parts
