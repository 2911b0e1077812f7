"""What gcp-storage-emulator honours of what gs:// relies on, each probed with google-cloud-storage.

It serves ranged reads, composes and resumable uploads; it ignores generation preconditions
(``ifGenerationMatch``) on writes, reads and deletes. The probes of what it lacks assert that it
lacks them: if an upgrade starts honouring them, these fail and the gs:// tests can drop
``require_preconditions=False`` (docs/object-storage.md).
"""

from __future__ import annotations

import pytest
from google.cloud import storage


@pytest.fixture
def bucket(gs_env, gs_bucket):
    return storage.Client().bucket(gs_bucket)


def test_ranged_reads_and_compose_are_served(bucket):
    bucket.blob("p1").upload_from_string(b"first-")
    bucket.blob("p2").upload_from_string(b"second")
    bucket.blob("c").compose([bucket.blob("p1"), bucket.blob("p2")])
    assert bucket.blob("c").download_as_bytes(start=3, end=8) == b"st-sec"


def test_generation_preconditions_are_ignored(bucket):
    blob = bucket.blob("a")
    blob.upload_from_string(b"1")
    blob.upload_from_string(b"2", if_generation_match=0)  # real GCS: 412
    blob.upload_from_string(b"3", if_generation_match=12345)  # real GCS: 412
    assert bucket.blob("a").download_as_bytes() == b"3"


def test_the_lock_refuses_a_store_that_ignores_preconditions_unless_told(gs_bucket):
    import mmapckpt
    import torch
    from mmapckpt import CheckpointWriteError
    url = f"gs://{gs_bucket}/refused"
    with pytest.raises(CheckpointWriteError, match="ignores generation preconditions"):
        mmapckpt.save({"a": torch.ones(2)}, url)
    from mmapckpt.storage import storage_for
    assert storage_for(url).list() == []  # nothing saved, and the lock object removed
