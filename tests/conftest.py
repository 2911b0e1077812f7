import atexit
import os
import sys
from collections.abc import Iterator

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # `import helpers` from tests and from spawned ranks

import s3server  # noqa: E402  (found through the line above)

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
