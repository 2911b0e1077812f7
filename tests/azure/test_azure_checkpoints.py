"""Checkpoints at ``az://CONTAINER/PREFIX`` on Azurite: round trips, resharded reads, overwrites, the lock, errors.

Round trips through ``dcp.save``/``dcp.load`` with MmapWriter/MmapReader and ``mmapckpt.save``/
``load``/``load_into``/``open`` are bitwise on the S3 tests' state dict (bf16, fp8, NaN payloads,
-0.0, empty), with blocks and ranged GETs small enough that a shard is several of each.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from s3_data import SMALL_PARTS, assert_same, complement, state_dict

import mmapckpt
from mmapckpt import (
    CheckpointNotFoundError,
    CheckpointWriteError,
    MmapReader,
    MmapWriter,
    StorageAccessError,
    StorageUnavailableError,
)
from mmapckpt.storage import storage_for

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def _blobs(azurite, container: str, prefix: str) -> list[str]:
    c = azurite.service().get_container_client(container)
    return sorted(b.name[len(prefix) + 1:] for b in c.list_blobs(name_starts_with=prefix + "/"))


def test_round_trips_are_bitwise_through_every_entry_point(az_env, az_container, azurite):
    sd = state_dict()
    url = f"az://{az_container}/run/a"
    dcp.save(sd, storage_writer=MmapWriter(url, storage_options=SMALL_PARTS), no_dist=True)
    targets = {n: complement(t) for n, t in sd.items()}
    dcp.load(targets, storage_reader=MmapReader(url, storage_options=SMALL_PARTS), no_dist=True)
    assert_same(targets, sd, "dcp.load: ")
    assert_same(mmapckpt.load(url, storage_options=SMALL_PARTS), sd, "load: ")
    into = {n: complement(t) for n, t in sd.items()}
    mmapckpt.load_into(into, url)
    assert_same(into, sd, "load_into: ")
    assert _blobs(azurite, az_container, "run/a") == [".metadata", "__0_0.distcp"]


def test_a_resharded_read_fetches_the_slice_only(az_env, az_container):
    sd = state_dict()
    url = f"az://{az_container}/sliced"
    mmapckpt.save(sd, url, storage_options=SMALL_PARTS)
    with mmapckpt.open(url) as f:
        rows = f.get_slice("emb")[100:140]
    assert torch.equal(rows.view(torch.int16), sd["emb"][100:140].view(torch.int16))
    # a row-sharded load of one tensor: rank 1 of 4 asks for its quarter
    with mmapckpt.open(url) as f:
        part = f.get_slice("big")[(3 << 20) // 4:(3 << 20) // 2]
    assert torch.equal(part.view(torch.int32), sd["big"][(3 << 20) // 4:(3 << 20) // 2].view(torch.int32))


def test_an_overwrite_reuses_no_committed_name_and_leaves_only_the_new_version(az_env, az_container, azurite):
    url = f"az://{az_container}/over"
    one, two = state_dict(salt=1), state_dict(salt=2)
    mmapckpt.save(one, url, storage_options=SMALL_PARTS)
    first = _blobs(azurite, az_container, "over")
    mmapckpt.save(two, url, storage_options=SMALL_PARTS)
    second = _blobs(azurite, az_container, "over")
    assert len(second) == 2 and set(first) & set(second) == {".metadata"}
    assert_same(mmapckpt.load(url), two)


def test_a_second_save_is_refused_while_one_holds_the_lock(az_env, az_container, azurite):
    url = f"az://{az_container}/locked"
    storage = MmapWriter(url).storage
    held = storage.lock()
    try:
        with pytest.raises(CheckpointWriteError, match="another save or conversion holds this location's lock"):
            mmapckpt.save({"a": torch.ones(3)}, url, storage_options={"lock_wait": 0.5})
        assert not storage.exists(".metadata")
    finally:
        held.release()
    mmapckpt.save({"a": torch.ones(3)}, url)
    assert _blobs(azurite, az_container, "locked") == [".metadata", "__0_0.distcp"]


def test_a_dead_holders_lease_is_broken_at_once(az_env, az_container, azurite):
    url = f"az://{az_container}/dead"
    blob = azurite.service().get_container_client(az_container).get_blob_client("dead/.mmapckpt-lock")
    # a lock a killed process of this job left: leased (for 60 s), its body naming it
    blob.upload_blob(json.dumps({"owner": "x", "job": "job-7", "pid": 1, "lease": 60}).encode())
    blob.acquire_lease(60)
    mmapckpt.save({"a": torch.ones(3)}, url, storage_options={"lock_wait": 0, "lock_job": "job-7"})
    assert_same(mmapckpt.load(url), {"a": torch.ones(3)})
    # a live holder on another host is waited for (here: not at all), never broken
    blob.upload_blob(json.dumps({"owner": "y", "host": "elsewhere", "pid": 1, "lease": 60}).encode(), overwrite=True)
    lease = blob.acquire_lease(60)
    try:
        with pytest.raises(CheckpointWriteError, match="holds this location's lock"):
            mmapckpt.save({"a": torch.zeros(3)}, url, storage_options={"lock_wait": 0})
    finally:
        lease.release()
    assert_same(mmapckpt.load(url), {"a": torch.ones(3)})


def test_a_save_whose_lease_was_broken_does_not_commit(az_env, az_container, azurite):
    from azure.storage.blob import BlobLeaseClient
    url = f"az://{az_container}/fenced"
    mmapckpt.save({"a": torch.ones(3)}, url)
    storage = storage_for(url)
    lock = storage.lock()
    try:
        blob = azurite.service().get_container_client(az_container).get_blob_client("fenced/.mmapckpt-lock")
        BlobLeaseClient(blob).break_lease(lease_break_period=0)  # another save took it over meanwhile
        with pytest.raises(CheckpointWriteError, match="lost its lock"):
            storage.commit(".metadata", b"not a commit", sync=True)
    finally:
        lock.release()
    assert_same(mmapckpt.load(url), {"a": torch.ones(3)})


def test_a_commit_after_another_saves_commit_is_refused(az_env, az_container):
    url = f"az://{az_container}/raced"
    mmapckpt.save({"a": torch.ones(3)}, url)
    storage = storage_for(url)
    lock = storage.lock()
    try:
        storage_for(url).commit(".metadata", b"another save's", sync=True)  # a save that took no lock
        with pytest.raises(CheckpointWriteError, match="commit was refused"):
            storage.commit(".metadata", b"this save's", sync=True)
    finally:
        lock.release()
    assert bytes(storage_for(url).read_file(".metadata", 100)) == b"another save's"


# --------------------------------------------------------------------------- errors
def test_a_missing_container_is_named_for_loads_and_saves(az_env):
    url = "az://no-such-container/ckpt"
    with pytest.raises(CheckpointNotFoundError):
        mmapckpt.load(url)
    with pytest.raises(CheckpointWriteError, match="no such container"):
        mmapckpt.save({"a": torch.ones(1)}, url)


def test_a_wrong_key_is_a_storage_access_error(azurite, az_container):
    bad = azurite.connection_string.replace("AccountKey=Eby8", "AccountKey=Xby8")
    mmapckpt.save({"a": torch.ones(1)}, f"az://{az_container}/k", storage_options=azurite.options())
    with pytest.raises(StorageAccessError) as e:
        mmapckpt.load(f"az://{az_container}/k", storage_options={"connection_string": bad})
    assert "Xby8" not in str(e.value)


def test_an_unreachable_endpoint_is_a_storage_unavailable_error(az_container):
    from emulators import AZURITE_ACCOUNT, AZURITE_KEY
    from s3server import free_port
    options = {"account_url": f"http://127.0.0.1:{free_port()}/{AZURITE_ACCOUNT}", "account_name": AZURITE_ACCOUNT,
               "account_key": AZURITE_KEY, "retries": 0, "connect_timeout": 1}
    with pytest.raises(StorageUnavailableError):
        mmapckpt.load(f"az://{az_container}/x", storage_options=options)


def test_no_credentials_are_refused_with_what_to_set():
    with pytest.raises(StorageAccessError, match="AZURE_STORAGE_CONNECTION_STRING"):
        storage_for("az://c/p")


def test_credentials_are_never_shown(azurite, az_container):
    from emulators import AZURITE_KEY
    url = f"az://{az_container}/shown"
    for options in (azurite.options(), {"account_url": azurite.endpoint, "account_name": "devstoreaccount1",
                                        "account_key": AZURITE_KEY},
                    {"account_url": azurite.endpoint, "sas_token": "sv=2024&sig=SECRETSIG"}):
        reader, writer = MmapReader(url, storage_options=options), MmapWriter(url, storage_options=options)
        for shown in (repr(reader), repr(writer), repr(reader.storage.opts), str(reader.storage_options)):
            assert AZURITE_KEY[:12] not in shown and "SECRETSIG" not in shown, shown


def test_a_blob_replaced_while_open_is_never_read_mixed(az_env, az_container):
    from mmapckpt import IncompleteCheckpointError
    url = f"az://{az_container}/replaced"
    storage = storage_for(url)
    storage.prepare()
    storage.commit("data.bin", bytes(range(256)) * 1024, sync=True)
    with storage.open_file("data.bin") as f:
        storage_for(url).commit("data.bin", bytes(256 * 1024), sync=True)  # another version under the name
        with pytest.raises(IncompleteCheckpointError, match="changed while it was being read"):
            f.read_into(100 << 10, bytearray(1000))
