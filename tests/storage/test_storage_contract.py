"""The storage contract (``mmapckpt.storage``, ``storage/base.py``), checked against every medium.

Each test runs once per medium: a local directory (``LocalStorage``), the ``unmapped://`` test
medium (tests/unmapped.py: no mappings, every byte through ``read_into``), S3 (a real Ceph
radosgw, tests/s3server.py), Azure Blob (Azurite) and GCS (gcp-storage-emulator); the object stores'
parameters are marked ``s3``, ``azure``, ``gcs`` and skipped without their server. They check what
base.py's docstrings promise, through the interface only. A new medium runs the same suite by adding
one entry to ``_MEDIA`` (a fixture that yields a factory of fresh, empty locations of it).

On the object stores, one trial more: saves killed at seeded moments and restarted at once
(``test_a_save_killed_at_any_moment_...``), each store's leftovers listed with its own client.
"""

from __future__ import annotations

import json
import os
import random
import select
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import s3server
import torch
from unmapped import SCHEME as UNMAPPED, Unmapped

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "s3"))
from s3_data import assert_same, state_dict  # noqa: E402  (the state dict every object-store test round-trips)

import mmapckpt
from mmapckpt.errors import (
    CheckpointNotFoundError,
    CheckpointWriteError,
    FormatError,
    IncompleteCheckpointError,
    TruncatedFileError,
    UnsafePathError,
)
from mmapckpt.format.metadata import METADATA_NAME
from mmapckpt.storage import CheckpointStorage, FileOutput, Lock, StoredFile, register_scheme, storage_for

Locations = Callable[[], CheckpointStorage]

HEAD = 16  # bytes of a file's head, written last (as a shard's header is)
PIECE = b"0123456789abcdef" * 64  # 1 KiB


# --------------------------------------------------------------------------- the media
@pytest.fixture
def local_media(tmp_path) -> Iterator[Locations]:
    yield lambda: storage_for(str(tmp_path / uuid.uuid4().hex))


@pytest.fixture
def unmapped_media(tmp_path) -> Iterator[Locations]:
    register_scheme(UNMAPPED, Unmapped)
    try:
        yield lambda: storage_for(f"{UNMAPPED}://{tmp_path / uuid.uuid4().hex}")
    finally:
        register_scheme(UNMAPPED, None)


@dataclass
class ObjectMedia:
    """Fresh locations of an object store: ``SCHEME://BUCKET/<random>``, each made with ``options``; ``stored(url)``
    lists what is under a location (objects, and S3's uploads in progress) with the store's own client."""

    bucket: str
    options: dict[str, Any]
    stored: Callable[[str], list[str]]

    def url(self) -> str:
        return f"{self.bucket}/{uuid.uuid4().hex}"

    def __call__(self) -> CheckpointStorage:
        return storage_for(self.url(), options=self.options)


def _prefix(url: str) -> tuple[str, str]:
    bucket, _, prefix = url.split("://", 1)[1].partition("/")
    return bucket, prefix + "/"


@pytest.fixture
def s3_media(s3_server: s3server.RadosGW) -> Iterator[ObjectMedia]:
    bucket = s3_server.new_bucket("contract")
    options = {"endpoint_url": s3_server.endpoint_url, "key": s3_server.access_key, "secret": s3_server.secret_key,
               "region_name": s3_server.region, "addressing_style": "path", "lock_lease": 30.0, "lock_wait": 1}
    client = s3_server.client()

    def stored(url: str) -> list[str]:
        b, prefix = _prefix(url)
        objects = client.list_objects_v2(Bucket=b, Prefix=prefix).get("Contents", [])
        uploads = client.list_multipart_uploads(Bucket=b, Prefix=prefix).get("Uploads", [])
        return sorted(o["Key"][len(prefix):] for o in objects) + [f"upload {u['Key']}" for u in uploads]

    try:
        yield ObjectMedia(f"s3://{bucket}", options, stored)
    finally:
        s3_server.empty_and_delete_bucket(bucket)


@pytest.fixture
def az_media(azurite) -> Iterator[ObjectMedia]:
    container = azurite.new_container("contract")

    def stored(url: str) -> list[str]:
        c, prefix = _prefix(url)
        return sorted(b.name[len(prefix):] for b in
                      azurite.service().get_container_client(c).list_blobs(name_starts_with=prefix))

    try:
        yield ObjectMedia(f"az://{container}", {**azurite.options(), "lock_wait": 1}, stored)
    finally:
        azurite.delete_container(container)


@pytest.fixture
def gs_media(gcs_emulator) -> Iterator[ObjectMedia]:
    bucket = gcs_emulator.new_bucket("contract")

    def stored(url: str) -> list[str]:
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import storage
        client = storage.Client(project="test", credentials=AnonymousCredentials(),
                                client_options={"api_endpoint": gcs_emulator.endpoint})
        b, prefix = _prefix(url)
        return sorted(o.name[len(prefix):] for o in client.list_blobs(b, prefix=prefix))

    # the emulator ignores generation preconditions: its lock is advisory (docs/object-storage.md)
    options = {**gcs_emulator.options(), "lock_wait": 1, "require_preconditions": False}
    yield ObjectMedia(f"gs://{bucket}", options, stored)


#: medium -> the fixture yielding its locations; a new medium adds its own here
_MEDIA = {"local": "local_media", "unmapped": "unmapped_media", "s3": "s3_media", "az": "az_media", "gs": "gs_media"}
_MARKS = {"s3": [pytest.mark.s3], "az": [pytest.mark.azure], "gs": [pytest.mark.gcs]}


@pytest.fixture(params=[pytest.param(m, marks=_MARKS.get(m, [])) for m in _MEDIA])
def new(request: pytest.FixtureRequest) -> Locations:
    """A factory of fresh, empty locations of the medium under test."""
    return request.getfixturevalue(_MEDIA[request.param])


def _written(st: CheckpointStorage, name: str, pieces: int = 3, *, size_known: bool = True) -> bytes:
    """Write file ``name`` through create_file/put/finish: its head (last) and ``pieces`` pieces; its bytes."""
    size = HEAD + pieces * len(PIECE)
    out = st.create_file(name, size if size_known else None, head=HEAD, direct=False, sync=True)
    for i in range(pieces):
        out.put(HEAD + i * len(PIECE), PIECE)
    head = bytes(range(HEAD))
    out.finish(head)
    return head + PIECE * pieces


# --------------------------------------------------------------------------- writing a file
@pytest.mark.parametrize("size_known", [True, False])
def test_a_file_appears_only_when_finished_and_reads_back(new: Locations, size_known: bool) -> None:
    st = new()
    st.prepare()
    out = st.create_file("__0_0.distcp", None if not size_known else HEAD + len(PIECE), head=HEAD, direct=False,
                         sync=True)
    assert isinstance(out, FileOutput)
    out.put(HEAD, PIECE)
    assert not st.exists("__0_0.distcp") and "__0_0.distcp" not in st.list()
    out.finish(b"h" * HEAD)
    assert st.exists("__0_0.distcp") and "__0_0.distcp" in st.list()
    with st.open_file("__0_0.distcp") as f:
        assert isinstance(f, StoredFile)
        assert f.size == HEAD + len(PIECE)
        assert bytes(f.read(0, f.size)) == b"h" * HEAD + PIECE


def test_an_aborted_file_leaves_nothing(new: Locations) -> None:
    st = new()
    st.prepare()
    before = sorted(st.list())
    out = st.create_file("__0_0.distcp", HEAD + 2 * len(PIECE), head=HEAD, direct=False, sync=True)
    out.put(HEAD, PIECE)
    out.abort()
    assert sorted(st.list()) == before  # no temporary file, no upload in progress
    assert not st.exists("__0_0.distcp")


# --------------------------------------------------------------------------- reading
def test_reads_return_the_bytes_written(new: Locations) -> None:
    st = new()
    st.prepare()
    data = _written(st, "f.distcp")
    with st.open_file("f.distcp") as f:
        assert f.size == len(data) and f.path == st.full("f.distcp") and "f.distcp" in f.path
        buf = bytearray(100)
        f.read_into(HEAD + 5, buf)
        assert bytes(buf) == data[HEAD + 5:HEAD + 105]
        bufs = [bytearray(10), bytearray(len(PIECE)), bytearray(1), bytearray(0)]
        offsets = [0, HEAD + len(PIECE), len(data) - 1, 7]
        f.read_batch(list(zip(offsets, bufs)))
        assert [bytes(b) for b in bufs] == [data[o:o + len(b)] for o, b in zip(offsets, bufs)]
        assert bytes(f.read(len(data), 0)) == b""
        assert (f.mapping is not None) == st.can_map
        f.check_unchanged()


@pytest.mark.parametrize("where", ["one past the end", "all and one more", "from the end", "far past"])
def test_reads_past_the_end_raise_truncated_file_error(new: Locations, where: str) -> None:
    st = new()
    st.prepare()
    data = _written(st, "f.distcp", pieces=1)
    at, length = {"one past the end": (len(data) - 1, 2), "all and one more": (0, len(data) + 1),
                  "from the end": (len(data), 1), "far past": (len(data) + 4096, 8)}[where]
    with st.open_file("f.distcp") as f:
        with pytest.raises(TruncatedFileError) as e:
            f.read(at, length, entry="w")
        assert "f.distcp" in str(e.value) and e.value.entry == "w"
        with pytest.raises(TruncatedFileError):
            f.read_into(at, bytearray(length), entry="w")
        with pytest.raises(TruncatedFileError):
            f.read_batch([(0, bytearray(1)), (at, bytearray(length))], entry="w")
        with pytest.raises(TruncatedFileError):
            f.read(-1, 1)


def test_a_missing_file_is_an_incomplete_checkpoint(new: Locations) -> None:
    st = new()
    st.prepare()
    _written(st, "a.distcp", pieces=1)
    with pytest.raises(IncompleteCheckpointError) as e:
        st.open_file("b.distcp")
    assert "b.distcp" in str(e.value)
    assert not st.exists("b.distcp")


@pytest.mark.parametrize("name", ["../outside.distcp", "../../etc/passwd"])
def test_a_name_leaving_the_location_is_refused(new: Locations, name: str) -> None:
    st = new()
    st.prepare()
    _written(st, "a.distcp", pieces=1)
    with pytest.raises(UnsafePathError):
        st.open_file(name)


def test_read_file_refuses_a_file_over_its_limit(new: Locations) -> None:
    st = new()
    st.prepare()
    data = _written(st, "index.json", pieces=1)
    assert bytes(st.read_file("index.json", len(data))) == data
    with pytest.raises(FormatError) as e:
        st.read_file("index.json", len(data) - 1)
    assert "index.json" in str(e.value)


# --------------------------------------------------------------------------- the commit
def test_commit_replaces_old_by_new_and_leaves_nothing_else(new: Locations) -> None:
    st = new()
    with pytest.raises(CheckpointNotFoundError):
        st.find_metadata()
    st.prepare()
    st.commit(METADATA_NAME, b"old commit", sync=True)
    assert st.find_metadata() == METADATA_NAME
    with st.open_file(METADATA_NAME) as f:
        old_ident = f.ident
    st.commit(METADATA_NAME, b"the new commit", sync=True)
    assert bytes(st.read_file(METADATA_NAME, 1 << 10)) == b"the new commit"
    assert st.list() == [METADATA_NAME]  # no temporary file beside it
    with st.open_file(METADATA_NAME) as f, st.open_file(METADATA_NAME) as g:
        assert f.ident == g.ident != old_ident  # the same file twice; not the one replaced


def test_shards_without_a_commit_are_an_incomplete_checkpoint(new: Locations) -> None:
    st = new()
    st.prepare()
    _written(st, "__0_0.distcp", pieces=1)
    with pytest.raises(IncompleteCheckpointError):
        st.find_metadata()


# --------------------------------------------------------------------------- list, exists, remove
def test_list_exists_and_remove(new: Locations) -> None:
    st = new()
    assert not st.is_location() and st.list() == [] and not st.exists("a")
    st.prepare()
    _written(st, "a.distcp", pieces=1)
    _written(st, "b.distcp", pieces=1)
    st.commit("notes.txt", b"kept", sync=True)
    assert st.is_location()
    assert sorted(st.list()) == ["a.distcp", "b.distcp", "notes.txt"]
    st.remove(["a.distcp", "missing.distcp"], sync=True)  # a missing name is no error
    assert sorted(st.list()) == ["b.distcp", "notes.txt"] and not st.exists("a.distcp") and st.exists("b.distcp")
    st.sync()


# --------------------------------------------------------------------------- the lock
def test_the_lock_is_exclusive_until_released(new: Locations) -> None:
    st = new()
    st.prepare()
    first = st.lock()
    assert isinstance(first, Lock)
    try:
        with pytest.raises(CheckpointWriteError):
            st.lock()
    finally:
        first.release()
    again = st.lock()
    again.release()


# --------------------------------------------------------------------------- killed saves, on the object stores
#: a child that overwrites one checkpoint again and again, two versions in turn (argv: url, tests/s3, options)
_SAVER = textwrap.dedent("""
    import json, sys, warnings
    warnings.filterwarnings("ignore")
    sys.path.insert(0, sys.argv[2])
    import mmapckpt
    from s3_data import state_dict
    versions = [state_dict(salt=1), state_dict(salt=2)]
    options = json.loads(sys.argv[3])
    mmapckpt.MmapWriter(sys.argv[1], storage_options=options).storage  # the client imported and made
    print("ready", flush=True)  # the parent's clock for the kill starts here, at the first save
    i = 0
    while True:
        mmapckpt.save(versions[i % 2], sys.argv[1], storage_options=options)  # a refused lock: a traceback
        print(i % 2, flush=True)
        i += 1
""")
#: medium -> (kills, seed, the kill's delay after "ready" in seconds, several parts a shard at these sizes, whether
#: some child must have finished a save: the kills also cover whole saves; the delays of the copies this trial
#: replaced, tests/s3/test_s3_crash_and_lock.py and tests/azure/test_azure_crash.py, and what each asserted)
_KILLS = {"s3": (12, 1234, (0.1, 3.0), {"part_size": 1 << 20, "upload_part_size": 5 << 20}, False),
          "az": (5, 46, (0.5, 4.0), {"part_size": 1 << 20, "upload_part_size": 2 << 20}, True),
          "gs": (5, 7, (0.5, 4.0), {"part_size": 1 << 20, "upload_part_size": 2 << 20}, False)}


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("medium", [pytest.param(m, marks=_MARKS[m]) for m in _KILLS])
def test_a_save_killed_at_any_moment_leaves_a_whole_checkpoint_and_its_restart_saves_at_once(
        request: pytest.FixtureRequest, medium: str) -> None:
    """A child overwrites one checkpoint and is SIGKILLed at a seeded moment, again and again; the next child is the
    restarted job, whose first save must take the killed one's lock over at once (``lock_wait=0``: never waiting
    for the 30 s lease: its holder's pid is gone). After every kill the checkpoint loads bitwise as one of the two
    versions; after the next save only ``.metadata`` and its shard remain (no object, no upload in progress)."""
    kills, seed, delay, parts, whole_saves = _KILLS[medium]
    media: ObjectMedia = request.getfixturevalue(_MEDIA[medium])
    url = media.url()
    options = {**media.options, **parts, "lock_wait": 0}
    versions = [state_dict(salt=1), state_dict(salt=2)]
    mmapckpt.save(versions[0], url, storage_options=options)
    rng = random.Random(seed)
    here = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "s3")
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID")}
    left_behind = saved = 0
    for trial in range(kills):
        child = subprocess.Popen([sys.executable, "-c", _SAVER, url, here, json.dumps(options)],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
        try:
            # the kill lands at a seeded moment of the save loop, however long the child took to start
            ready, _, _ = select.select([child.stdout], [], [], 120)
            line = child.stdout.readline() if ready else b""  # type: ignore[union-attr]
            assert line == b"ready\n", "the saving process did not start"
            time.sleep(rng.uniform(*delay))
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait(timeout=30)
        out = child.stdout.read().decode()  # type: ignore[union-attr]
        err = child.stderr.read().decode()  # type: ignore[union-attr]
        child.stdout.close()  # type: ignore[union-attr]
        child.stderr.close()  # type: ignore[union-attr]
        assert "Traceback" not in err, err
        saved += len(out.split())
        got = mmapckpt.load(url, storage_options=options)
        match = [i for i, v in enumerate(versions)
                 if all(torch.equal(got[n].view(torch.uint8), v[n].view(torch.uint8)) if v[n].numel() else True
                        for n in v)]
        assert match, f"trial {trial}: the checkpoint is neither version ({out.split()[-3:]} saved)"
        left_behind += len(media.stored(url)) - 2  # the killed save's lock object, parts, uploads
    # some kill caught a save in progress (a count, not a timing)
    assert left_behind > 0, "no kill caught a save in progress: the trial timing no longer covers a save"
    assert saved > 0 or not whole_saves, "no child finished a save: the kills no longer cover whole saves"
    mmapckpt.save(versions[1], url, storage_options=options)  # at once: the last killed save's lock is taken over
    stored = media.stored(url)
    assert len(stored) == 2 and ".metadata" in stored, stored
    assert_same(mmapckpt.load(url, storage_options=options), versions[1])
