"""Fixtures for the tests against Azurite, Microsoft's Azure Storage emulator (tests/emulators.py).

Every test here is marked ``azure`` and needs the session's Azurite (the ``azurite`` fixture of
tests/conftest.py), started on the first test that needs it (about a second) and stopped by PID at
the end; skipped without npm's azurite, unless MMAPCKPT_REQUIRE_S3=1 (.ci/run), which fails instead.
The test data are the S3 tests' (tests/s3/s3_data.py).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import emulators
import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "s3"))  # s3_data: the state dict every object-store test round-trips


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in Path(item.path).resolve().parents:
            item.add_marker(pytest.mark.azure)


@pytest.fixture(autouse=True)
def _needs_azurite(azurite: emulators.Azurite, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test here needs the emulator; the developer's own Azure settings cannot leak in."""
    for name in list(os.environ):
        if name.startswith("AZURE_"):
            monkeypatch.delenv(name)


@pytest.fixture
def az_container(azurite: emulators.Azurite) -> Iterator[str]:
    """A fresh, empty container for this test; deleted afterwards."""
    name = azurite.new_container()
    yield name
    azurite.delete_container(name)


@pytest.fixture
def az_env(azurite: emulators.Azurite, monkeypatch: pytest.MonkeyPatch) -> str:
    """AZURE_STORAGE_CONNECTION_STRING pointing at the emulator, for this test only (the standard environment)."""
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite.connection_string)
    return azurite.connection_string
