"""Fixtures for the tests against a real S3 server: Ceph's radosgw on 127.0.0.1 (tests/s3server.py).

Every test under tests/s3 is marked `s3` and needs the server: one for the whole session (the `s3_server`
fixture of tests/conftest.py, shared with the storage contract tests), started on the first test that
needs it (a few seconds) and stopped at the end. Without Debian's radosgw packages
the tests are skipped, unless MMAPCKPT_REQUIRE_S3=1 (set by .ci/run), which makes them fail instead.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import s3server

HERE = Path(__file__).resolve().parent


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in Path(item.path).resolve().parents:
            item.add_marker(pytest.mark.s3)


@pytest.fixture(autouse=True)
def _needs_s3_server(s3_server: s3server.RadosGW) -> None:
    """Every test here needs the server: skipped (or failed) together when it is unavailable."""


@pytest.fixture
def s3_bucket(s3_server: s3server.RadosGW) -> Iterator[str]:
    """A fresh, empty bucket for this test; emptied and deleted afterwards."""
    name = s3_server.new_bucket()
    yield name
    s3_server.empty_and_delete_bucket(name)


@pytest.fixture
def s3_env(s3_server: s3server.RadosGW, monkeypatch: pytest.MonkeyPatch,
           tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION pointing at the server, for
    this test only; every other AWS_* / FSSPEC_S3* variable is removed and the shared config and
    credentials files point at nothing, so the developer's own AWS setup cannot leak in."""
    for name in list(os.environ):
        if name.startswith(("AWS_", "FSSPEC_S3", "BOTO_")):
            monkeypatch.delenv(name)
    nothing = tmp_path_factory.getbasetemp() / "no-aws-config"  # never created
    monkeypatch.setenv("AWS_CONFIG_FILE", str(nothing))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(nothing))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    env = s3_server.env()
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return env
