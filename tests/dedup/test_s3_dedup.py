"""Steps of a managed root on S3 (the session's radosgw, tests/s3server.py) refer to each other's objects."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import mmapckpt
from helpers import assert_bitwise_equal
from mmapckpt.errors import UnsafePathError
from mmapckpt.format.entries import ROOT_MARKER
from roots import MARKER, frozen_and_trained, save_step

pytestmark = pytest.mark.s3


@pytest.fixture
def root(s3_server: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, Any, str]]:
    """(the root's URL, a client, its bucket): ``s3://BUCKET/run`` holding the root marker."""
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    bucket = s3_server.new_bucket()
    client = s3_server.client()
    client.put_object(Bucket=bucket, Key=f"run/{ROOT_MARKER}", Body=MARKER.encode())
    try:
        yield f"s3://{bucket}/run", client, bucket
    finally:
        s3_server.empty_and_delete_bucket(bucket)


def _sizes(client: Any, bucket: str, step: int) -> int:
    objs = client.list_objects_v2(Bucket=bucket, Prefix=f"run/step-{step}/")["Contents"]
    return sum(o["Size"] for o in objs if o["Key"].endswith(".distcp"))


def test_a_step_on_s3_refers_to_the_previous_steps_objects_and_loads_bitwise(root: tuple[str, Any, str]) -> None:
    url, client, bucket = root
    s1 = frozen_and_trained(1)
    save_step(url, 1, s1)
    s2 = dict(s1, **{"head.w": torch.randn(64, 8), "step": 2})
    save_step(url, 2, s2, reuse=(1,))
    assert _sizes(client, bucket, 2) < _sizes(client, bucket, 1) / 4
    got = mmapckpt.load(f"{url}/step-2")
    targets = {k: (torch.empty_like(v) if isinstance(v, torch.Tensor) else 0) for k, v in s2.items()}
    dcp.load(targets, storage_reader=mmapckpt.MmapReader(f"{url}/step-2", verify=True), no_dist=True)
    for k, v in s2.items():
        if isinstance(v, torch.Tensor):
            assert_bitwise_equal(got[k], v, k)
            assert_bitwise_equal(targets[k], v, k)
    assert not mmapckpt.verify_checkpoint(f"{url}/step-2").problems
    client.delete_object(Bucket=bucket, Key=f"run/{ROOT_MARKER}")  # no longer a root: the references leave it
    with pytest.raises(UnsafePathError, match=ROOT_MARKER):
        mmapckpt.load(f"{url}/step-2")
