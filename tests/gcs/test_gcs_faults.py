"""Broken connections between mmapckpt and the GCS emulator, injected by a TCP proxy (tests/s3/faulty_proxy.py).

- A response body cut mid-way is asked for again from its first missing byte (storage/ranged.py, the core every
  store reads through), and the load is bitwise.
- A service that cuts every body fails with StorageUnavailableError once the retries allowed are spent.
"""

from __future__ import annotations


import emulators
import pytest
from faulty_proxy import FaultyProxy, proxies_to
from s3_data import assert_same, complement, state_dict

import mmapckpt

PART = 1 << 20
OPTIONS = {"require_preconditions": False, "part_size": PART}


@pytest.fixture
def saved(gs_bucket: str):
    sd = state_dict(salt=6)
    url = f"gs://{gs_bucket}/faults"
    mmapckpt.save(sd, url, storage_options=OPTIONS)
    return url, sd


@pytest.fixture
def through_proxy(gcs_emulator: emulators.GCSEmulator):
    with proxies_to(gcs_emulator.endpoint) as proxy:
        def make(**faults) -> tuple[FaultyProxy, dict[str, object]]:
            p = proxy(**faults)
            return p, {**OPTIONS, "endpoint_url": p.endpoint_url}
        yield make


def test_an_object_body_cut_midway_is_asked_for_again_from_its_first_missing_byte(saved, through_proxy):
    url, sd = saved
    proxy, options = through_proxy(cut_after=PART // 2 + 12345, cuts=2)
    targets = {n: complement(t) for n, t in sd.items()}
    mmapckpt.load_into(targets, url, storage_options={**options, "concurrency": 2})
    assert_same(targets, sd)
    assert proxy.cut == 2
    assert len(proxy.resumed()) == 2, f"the cut bodies were not resumed where they broke off: {proxy.ranges}"


@pytest.mark.timeout(120)
def test_a_gcs_that_keeps_cutting_bodies_is_unavailable_after_the_retries(saved, through_proxy):
    url, sd = saved
    _, options = through_proxy(cut_after=200_000, cuts=10_000)
    targets = {n: complement(t) for n, t in sd.items()}
    with pytest.raises(mmapckpt.StorageUnavailableError, match="unreachable or stopped answering.*STORAGE_EMULATOR"):
        mmapckpt.load_into(targets, url, storage_options={**options, "retries": 2})
