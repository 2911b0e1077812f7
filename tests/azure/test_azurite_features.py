"""What Azurite honours of what az:// relies on, each probed through azure-storage-blob itself.

If an Azurite upgrade stops honouring one, the probe fails here, by name, rather than a lock or
commit test passing by luck. (All of these are documented Azure Blob behaviour; the emulator is
what the tests can reach.)
"""

from __future__ import annotations

import pytest
from azure.core import MatchConditions
from azure.core.exceptions import HttpResponseError
from azure.storage.blob import BlobLeaseClient


@pytest.fixture
def blob(azurite, az_container):
    return azurite.service().get_container_client(az_container).get_blob_client("probe")


def test_create_if_absent_is_refused_where_the_blob_exists(blob):
    blob.upload_blob(b"a", overwrite=False)
    with pytest.raises(HttpResponseError) as e:
        blob.upload_blob(b"b", overwrite=False)  # If-None-Match: *
    assert e.value.status_code == 409 and blob.download_blob().readall() == b"a"


def test_if_match_is_honoured_on_writes_reads_and_leases(blob):
    etag = blob.upload_blob(b"0123456789")["etag"]
    blob.upload_blob(b"abcdefghij", overwrite=True)
    stale = {"etag": etag, "match_condition": MatchConditions.IfNotModified}
    for op in (lambda: blob.upload_blob(b"x", overwrite=True, **stale),
               lambda: blob.download_blob(offset=2, length=3, **stale).readall(),
               lambda: blob.acquire_lease(15, **stale),
               lambda: BlobLeaseClient(blob).break_lease(lease_break_period=0, **stale)):
        with pytest.raises(HttpResponseError) as e:
            op()
        assert e.value.status_code == 412
    assert blob.download_blob(offset=2, length=3).readall() == b"cde"  # ranged reads


def test_a_lease_is_exclusive_guards_writes_and_a_broken_one_cannot_be_renewed(blob):
    blob.upload_blob(b"a")
    lease = blob.acquire_lease(15)
    with pytest.raises(HttpResponseError) as e:
        blob.acquire_lease(15)
    assert e.value.status_code == 409
    with pytest.raises(HttpResponseError) as e:
        blob.upload_blob(b"b", overwrite=True)  # no lease id
    assert e.value.status_code == 412
    blob.upload_blob(b"c", overwrite=True, lease=lease)
    BlobLeaseClient(blob).break_lease(lease_break_period=0)
    with pytest.raises(HttpResponseError) as e:
        lease.renew()
    assert e.value.status_code == 409
    blob.acquire_lease(15).release()


def test_staged_blocks_are_invisible_until_the_block_list_places_them(azurite, az_container):
    container = azurite.service().get_container_client(az_container)
    blob = container.get_blob_client("probe")
    blob.stage_block("YjI=", b"second")
    blob.stage_block("YjE=", b"first-")
    assert [b.name for b in container.list_blobs()] == []
    blob.commit_block_list(["YjE=", "YjI="])
    assert blob.download_blob().readall() == b"first-second"
