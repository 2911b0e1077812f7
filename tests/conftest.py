import atexit
import os
import sys
from collections.abc import Iterator

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # `import helpers` from tests and from spawned ranks

import emulators  # noqa: E402  (found through the line above)
import s3server  # noqa: E402

# The cold-read choice (io/read_choice.py) keeps its samples in a per-user file across processes; the suite keeps
# them in memory only, so that tests neither read what another run measured nor leave files behind
# (tests/io/test_read_choice_state.py turns it on, in a temporary directory).
os.environ.setdefault("MMAPCKPT_READ_CHOICE", "off")


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[s3server.RadosGW]:
    """The session's one radosgw (tests/s3server.py: endpoint_url, access_key, secret_key, region, client(),
    new_bucket()), for tests/s3 and the S3 cases of tests/storage/test_storage_contract.py. Without Debian's
    radosgw packages the tests needing it are skipped, unless MMAPCKPT_REQUIRE_S3=1 (set by .ci/run), which
    makes them fail instead."""
    missing = s3server.missing_binaries()
    if missing:
        reason = (f"no Ceph radosgw here (missing {', '.join(missing)}; "
                  "apt-get install radosgw ceph-mon ceph-osd ceph-common)")
        if os.environ.get("MMAPCKPT_REQUIRE_S3") == "1":
            pytest.fail(f"MMAPCKPT_REQUIRE_S3=1 but {reason}", pytrace=False)
        pytest.skip(reason)
    server = s3server.RadosGW(tmp_path_factory.mktemp("radosgw"))
    atexit.register(server.stop)  # a session ended by Ctrl-C or an internal error still stops the daemons
    try:
        server.start()  # on failure it has stopped what it started and raises with the logs' tails
        yield server
    finally:
        try:
            server.stop(remove_data=True)
        finally:
            atexit.unregister(server.stop)


# --------------------------------------------------------------------------- the emulators of az:// and gs://
def _emulator(tmp_path_factory: pytest.TempPathFactory, missing: str | None, make):  # type: ignore[no-untyped-def]
    """Start one emulator (tests/emulators.py) for the session; stopped by PID at the end. Missing: skipped, or
    failed where MMAPCKPT_REQUIRE_S3=1 (.ci/run), as the radosgw fixture does."""
    if missing:
        if os.environ.get("MMAPCKPT_REQUIRE_S3") == "1":
            pytest.fail(f"MMAPCKPT_REQUIRE_S3=1 but {missing}", pytrace=False)
        pytest.skip(missing)
    server = make(tmp_path_factory.mktemp(make.__name__.lower()))
    atexit.register(server.stop)
    try:
        server.start()
        yield server
    finally:
        try:
            server.stop()
        finally:
            atexit.unregister(server.stop)


@pytest.fixture(scope="session")
def azurite(tmp_path_factory: pytest.TempPathFactory) -> Iterator[emulators.Azurite]:
    """The session's Azurite (tests/emulators.py): ``connection_string``, ``options()``, ``new_container()``.
    Needs npm's azurite (.ci/run installs it) and node, and azure-storage-blob (the test extra)."""
    missing = None if emulators.azurite_binary() else "no Azurite (npm install azurite; .ci/run does) or no node"
    try:
        import azure.storage.blob  # noqa: F401
    except ImportError:
        missing = "azure-storage-blob is not installed (the test extra)"
    yield from _emulator(tmp_path_factory, missing, emulators.Azurite)


@pytest.fixture(scope="session")
def gcs_emulator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[emulators.GCSEmulator]:
    """The session's gcp-storage-emulator (tests/emulators.py): ``endpoint``, ``options()``, ``new_bucket()``."""
    yield from _emulator(tmp_path_factory, emulators.gcs_emulator_missing(), emulators.GCSEmulator)
