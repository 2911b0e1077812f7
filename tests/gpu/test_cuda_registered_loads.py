"""Staged loads with registered pages (``MMAPCKPT_REGISTER_BYTES``) on a real CUDA device. Skipped without CUDA.

tests/io/test_registered_staging.py checks the bookkeeping on the CPU; here the real driver
registers a cached shard's pages read-only and the copy engine reads them: every load bitwise
equal, the bytes really copied from registered pages, nothing left registered afterwards.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import helpers
import mmapckpt
from helpers import seeded_tensor
from mmapckpt.io import staging
from mmapckpt.io.host_register import REGISTER_ENV, registry_from_env

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture
def registering(monkeypatch):
    monkeypatch.setenv(REGISTER_ENV, "64MiB")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        try:
            probe = registry_from_env(torch.device("cuda"))
        except RuntimeWarning as w:
            pytest.skip(f"this driver cannot register mapped pages read-only: {w}")
    probe.close()
    reports: list[dict] = []
    monkeypatch.setattr(staging, "STATS_HOOK", reports.append)
    return reports


def _sd() -> dict[str, torch.Tensor]:
    return {"w": seeded_tensor("w", (3_000_000,), torch.float32),  # 12 MB: several 16 MiB-capped windows
            "b": seeded_tensor("b", (1000, 333), torch.bfloat16),
            "s": seeded_tensor("s", (7,), torch.int64)}


@pytest.mark.parametrize("how", ["load_into", "dcp", "load"])
def test_a_cached_checkpoint_loads_from_registered_pages_bitwise(tmp_path, registering, how):
    from mmapckpt.bench.system import files_under, warm_up

    sd = _sd()
    if how == "dcp":
        helpers.dcp_save(sd, mmapckpt.MmapWriter(tmp_path / "c"))
    else:
        mmapckpt.save(sd, tmp_path / "c")
    warm_up(files_under(str(tmp_path / "c")))  # a save may write around the page cache: only cached files register
    if how == "dcp":
        out = {k: torch.empty_like(v, device="cuda") for k, v in sd.items()}
        reader = mmapckpt.MmapReader(tmp_path / "c")
        helpers.dcp_load(out, reader)
        reader.close()
    elif how == "load_into":
        out = {k: torch.empty_like(v, device="cuda") for k, v in sd.items()}
        mmapckpt.load_into(out, tmp_path / "c")
    else:
        out = mmapckpt.load(tmp_path / "c", device="cuda")
    torch.cuda.synchronize()
    helpers.assert_tree_equal({k: v.cpu() for k, v in out.items()}, sd)
    assert registering, "no staging pool reported"
    r = registering[-1]
    assert r["registered_bytes"] > 0 and r["registrations"] > 0, r  # the pages were registered and read
    assert r["register_peak_bytes"] <= 64 << 20
