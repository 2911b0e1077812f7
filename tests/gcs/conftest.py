"""Fixtures for the tests against gcp-storage-emulator, a GCS stub (tests/emulators.py).

Every test here is marked ``gcs`` and needs the session's emulator (the ``gcs_emulator`` fixture of
tests/conftest.py), stopped by PID at the end; skipped without it unless MMAPCKPT_REQUIRE_S3=1.
The emulator ignores generation preconditions (test_gcs_emulator_features.py says so by test), so
saves here pass ``require_preconditions=False``; what it lacks is covered on paper in
docs/object-storage.md. The test data are the S3 tests' (tests/s3/s3_data.py).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import emulators
import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "s3"))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in Path(item.path).resolve().parents:
            item.add_marker(pytest.mark.gcs)


@pytest.fixture(autouse=True)
def gs_env(gcs_emulator: emulators.GCSEmulator, monkeypatch: pytest.MonkeyPatch) -> str:
    """STORAGE_EMULATOR_HOST pointing at the emulator (the standard environment); no other Google setting."""
    for name in list(os.environ):
        if name.startswith(("GOOGLE_", "GCLOUD_", "CLOUDSDK_")) or name == "STORAGE_EMULATOR_HOST":
            monkeypatch.delenv(name)
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_emulator.endpoint)
    return gcs_emulator.endpoint


@pytest.fixture
def gs_bucket(gcs_emulator: emulators.GCSEmulator) -> str:
    return gcs_emulator.new_bucket()
