"""Fixtures of the local cache's tests (storage/cache/): the session's radosgw (tests/conftest.py), a fresh bucket,
the environment pointing at the server, and a cache directory. Marked ``s3`` as tests/s3 is."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import s3server

HERE = Path(__file__).resolve().parent
S3_TESTS = str(HERE.parent / "s3")
if S3_TESTS not in sys.path:
    sys.path.insert(0, S3_TESTS)  # s3_data: the object-store tests' data and GET counter


#: the files whose tests need no server (a medium of their own: tests/unmapped.py)
_NO_SERVER = ("test_cache_generic.py", "test_cache_filling.py")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in Path(item.path).resolve().parents and Path(item.path).name not in _NO_SERVER:
            item.add_marker(pytest.mark.s3)


@pytest.fixture
def bucket(s3_server: s3server.RadosGW) -> Iterator[str]:
    name = s3_server.new_bucket("cache")
    yield name
    s3_server.empty_and_delete_bucket(name)


@pytest.fixture
def env(s3_server: s3server.RadosGW, monkeypatch: pytest.MonkeyPatch,
        tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The server's AWS_* settings for this test only (the developer's own AWS setup and cache cannot leak in)."""
    for name in list(os.environ):
        if name.startswith(("AWS_", "FSSPEC_S3", "BOTO_", "MMAPCKPT_CACHE")):
            monkeypatch.delenv(name)
    nothing = tmp_path_factory.getbasetemp() / "no-aws-config"
    monkeypatch.setenv("AWS_CONFIG_FILE", str(nothing))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(nothing))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    env = s3_server.env()
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return env


@pytest.fixture
def cache(tmp_path: Path) -> str:
    return str(tmp_path / "cache")
