"""Transient failures between mmapckpt and the real S3 server, injected by a TCP proxy (tests/s3/faulty_proxy.py).

- A response body cut mid-way is read again from its first missing byte (a ranged GET that
  starts inside the part), and the load is bitwise.
- ``503 Slow Down`` answers are retried by the client with backoff; the load is bitwise.
- A store that keeps cutting every body fails with StorageUnavailableError once the retries
  allowed are spent: in bounded time, never a hang.
"""

from __future__ import annotations


import pytest
import torch.distributed.checkpoint as dcp
from faulty_proxy import FaultyProxy, proxies_to
from s3_data import GetCounter, assert_same, complement, state_dict

import mmapckpt
from mmapckpt import MmapReader

PART = 1 << 20


@pytest.fixture
def saved(s3_env, s3_bucket):
    sd = state_dict(salt=4)
    url = f"s3://{s3_bucket}/faults"
    mmapckpt.save(sd, url)
    return url, sd


@pytest.fixture
def proxy_for(s3_server, monkeypatch):
    with proxies_to(s3_server.endpoint_url) as proxy:
        def make(**faults) -> FaultyProxy:
            p = proxy(**faults)
            monkeypatch.setenv("AWS_ENDPOINT_URL", p.endpoint_url)
            return p
        yield make


def _load(url, sd, options):
    targets = {n: complement(t) for n, t in sd.items()}
    dcp.load(targets, storage_reader=MmapReader(url, storage_options=options), no_dist=True)
    return targets


def test_a_body_cut_midway_is_resumed_from_its_first_missing_byte(saved, proxy_for):
    url, sd = saved
    # each of the first two connections is cut ~0.5 MiB into what it carries: past the few KiB of
    # metadata and the 64 KiB shard head, inside the body of a 1 MiB GET of data
    proxy = proxy_for(cut_after=PART // 2 + 12345, cuts=2)
    options = {"part_size": PART, "concurrency": 2}
    with GetCounter(options) as gets:
        got = _load(url, sd, options)
    assert_same(got, sd)
    assert proxy.cut == 2
    # a resumed GET: the tail of an earlier request, from a byte inside it to the same end
    resumed = [r for i, r in enumerate(gets.ranges)
               if any(q[0] == r[0] and q[1] < r[1] < q[2] and q[2] == r[2] for q in gets.ranges[:i])]
    assert len(resumed) == 2, f"the cut bodies were not resumed where they broke off: {gets.ranges}"


def test_slow_down_answers_are_retried(saved, proxy_for):
    url, sd = saved
    proxy = proxy_for(refuse=3)
    assert_same(_load(url, sd, {"part_size": PART}), sd)
    assert proxy.refused == 3


@pytest.mark.timeout(120)
def test_a_store_that_keeps_failing_is_unavailable_after_the_retries(saved, proxy_for):
    url, sd = saved
    proxy_for(cut_after=100_000, cuts=10_000)
    targets = {n: complement(t) for n, t in sd.items()}
    with pytest.raises(mmapckpt.StorageUnavailableError, match="unreachable or stopped answering"):
        mmapckpt.load_into(targets, url, storage_options={"part_size": PART, "retries": 2})
