"""Fixtures of the managed-root tests: a fresh root on each medium (a local directory; a bucket of the session's
radosgw, tests/conftest.py ``s3_server``, for the cases marked ``s3``)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from manage_data import s3_options


@dataclass
class Medium:
    root: str
    options: dict[str, str] | None
    client: Any = None  # boto3's, for looking at the objects without mmapckpt

    @property
    def is_s3(self) -> bool:
        return self.root.startswith("s3://")


def _medium(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[Medium]:
    if request.param == "local":
        yield Medium(str(tmp_path / "run"), None)
        return
    server = request.getfixturevalue("s3_server")
    bucket = server.new_bucket()
    try:
        yield Medium(f"s3://{bucket}/run", s3_options(server), server.client())
    finally:
        server.empty_and_delete_bucket(bucket)


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.s3)])
def medium(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[Medium]:
    """A root on each medium, not yet created."""
    yield from _medium(request, tmp_path)


@pytest.fixture(params=[pytest.param("s3", marks=pytest.mark.s3)])
def s3_medium(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[Medium]:
    """A root on the radosgw only."""
    yield from _medium(request, tmp_path)
