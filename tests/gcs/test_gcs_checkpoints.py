"""Checkpoints at ``gs://BUCKET/PREFIX`` on gcp-storage-emulator: round trips, resharded reads, overwrites, errors.

Parts of 1 MiB, so the S3 tests' state dict (bf16, fp8, NaN payloads, -0.0, empty; a 12 MiB tensor)
is composed from many parts and read in many ranged GETs.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from s3_data import assert_same, complement, state_dict

import mmapckpt
from mmapckpt import CheckpointNotFoundError, CheckpointWriteError, MmapReader, MmapWriter, StorageUnavailableError
from mmapckpt.storage import storage_for

warnings.filterwarnings("ignore", message="torch.distributed is disabled")

#: the emulator ignores generation preconditions (test_gcs_emulator_features.py): an advisory lock; 1 MiB GETs and
#: parts, so that the state dict is composed from many parts and read in many requests
OPTIONS = {"require_preconditions": False, "part_size": 1 << 20, "upload_part_size": 1 << 20}


def _objects(bucket: str, prefix: str) -> list[str]:
    from google.cloud import storage
    return sorted(b.name[len(prefix) + 1:] for b in storage.Client().list_blobs(bucket, prefix=prefix + "/"))


def test_round_trips_are_bitwise_through_every_entry_point(gs_bucket):
    sd = state_dict()
    url = f"gs://{gs_bucket}/run/a"
    dcp.save(sd, storage_writer=MmapWriter(url, storage_options=OPTIONS), no_dist=True)
    assert _objects(gs_bucket, "run/a") == [".metadata", "__0_0.distcp"]  # no part left over
    targets = {n: complement(t) for n, t in sd.items()}
    dcp.load(targets, storage_reader=MmapReader(url, storage_options=OPTIONS), no_dist=True)
    assert_same(targets, sd, "dcp.load: ")
    assert_same(mmapckpt.load(url, storage_options=OPTIONS), sd, "load: ")
    into = {n: complement(t) for n, t in sd.items()}
    mmapckpt.load_into(into, url, storage_options=OPTIONS)
    assert_same(into, sd, "load_into: ")


def test_a_resharded_read_fetches_the_slice(gs_bucket):
    sd = state_dict()
    url = f"gs://{gs_bucket}/sliced"
    mmapckpt.save(sd, url, storage_options=OPTIONS)
    with mmapckpt.open(url, storage_options=OPTIONS) as f:
        rows = f.get_slice("emb")[100:140]
        part = f.get_slice("big")[(3 << 20) // 4:(3 << 20) // 2]
    assert torch.equal(rows.view(torch.int16), sd["emb"][100:140].view(torch.int16))
    assert torch.equal(part.view(torch.int32), sd["big"][(3 << 20) // 4:(3 << 20) // 2].view(torch.int32))


def test_an_overwrite_leaves_only_the_new_version(gs_bucket):
    url = f"gs://{gs_bucket}/over"
    one, two = state_dict(salt=1), state_dict(salt=2)
    mmapckpt.save(one, url, storage_options=OPTIONS)
    first = _objects(gs_bucket, "over")
    mmapckpt.save(two, url, storage_options=OPTIONS)
    second = _objects(gs_bucket, "over")
    assert len(second) == 2 and set(first) & set(second) == {".metadata"}
    assert_same(mmapckpt.load(url, storage_options=OPTIONS), two)


def test_a_killed_uploads_parts_are_removed_by_the_next_save(gs_bucket):
    url = f"gs://{gs_bucket}/killed"
    mmapckpt.save({"a": torch.ones(3)}, url, storage_options=OPTIONS)
    st = storage_for(url, options=OPTIONS)
    out = st.create_file("__0_0.1234abcd.distcp", None, head=16, direct=False, sync=True)
    out.put(16, bytes(3 << 20))  # three parts uploaded, then the process "dies" (no finish, no abort)
    out._close_threads()
    left = [n for n in st.list() if ".tmp-" in n]
    assert len(left) == 3, st.list()
    mmapckpt.save({"a": torch.zeros(3)}, url, storage_options=OPTIONS)
    names = st.list()
    assert len(names) == 2 and ".metadata" in names and not [n for n in names if ".tmp-" in n], names


def test_a_missing_bucket_is_named_for_loads_and_saves():
    url = "gs://no-such-bucket/ckpt"
    with pytest.raises(CheckpointNotFoundError):
        mmapckpt.load(url, storage_options=OPTIONS)
    with pytest.raises(CheckpointWriteError, match="no such bucket"):
        mmapckpt.save({"a": torch.ones(1)}, url, storage_options=OPTIONS)


def test_an_unreachable_endpoint_is_a_storage_unavailable_error(gs_bucket, monkeypatch):
    from s3server import free_port
    options = {**OPTIONS, "endpoint_url": f"http://127.0.0.1:{free_port()}", "retries": 1, "timeout": 2}
    with pytest.raises(StorageUnavailableError):
        mmapckpt.load(f"gs://{gs_bucket}/x", storage_options=options)


def test_credentials_are_never_shown(gs_bucket, tmp_path):
    url = f"gs://{gs_bucket}/shown"
    reader = MmapReader(url, storage_options={"token": str(tmp_path / "sa-SECRETFILE.json"), "project": "p"})
    assert "SECRETFILE" not in repr(reader) and "SECRETFILE" not in str(reader.storage_options)
