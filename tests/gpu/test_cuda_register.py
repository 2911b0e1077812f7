"""Read-only cudaHostRegister of a mapped mmapckpt shard (io/host_register.py) on a real device. Skipped without CUDA.

tests/io/test_host_register.py checks the registry's bookkeeping on the CPU with a driver that
enforces the CUDA driver's rules; here the real driver registers the shard's page-cache pages
and a non_blocking copy from a view of them lands bitwise on the device.
"""

from __future__ import annotations

import glob
import os
import warnings

import pytest
import torch

import helpers
import mmapckpt
from mmapckpt.io.host_register import PAGE, HostRegistry, cuda_host_driver
from mmapckpt.io.mapped import MappedFile, open_regular

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
warnings.filterwarnings("ignore", message="torch.distributed is disabled")


@pytest.fixture
def shard(tmp_path):
    sd = {"w": helpers.seeded_tensor("w", (1 << 20,), torch.bfloat16),
          "b": helpers.seeded_tensor("b", (4097,), torch.float32)}
    mmapckpt.save(sd, str(tmp_path / "ckpt"))
    files = [f for f in glob.glob(str(tmp_path / "ckpt" / "*")) if not f.endswith(".metadata")]
    path = max(files, key=os.path.getsize)
    fd = open_regular(path)
    mf = MappedFile(fd, path)
    os.close(fd)
    with open(path, "rb") as f:
        data = f.read()
    return mf, data


def _driver():
    driver, why = cuda_host_driver()
    if driver is None:
        pytest.skip(f"read-only host registration unsupported here: {why}")
    return driver


def test_a_registered_view_copies_bitwise_without_blocking_and_reads_as_pinned(shard):
    mf, data = shard
    driver = _driver()
    lo = mf.address()
    reg = HostRegistry(len(data) + PAGE, driver, window_bytes=1 << 20)
    view = mf.raw(0, len(data))
    assert not view.is_pinned()
    h = reg.acquire(lo, len(data), (lo, lo + len(data)))
    assert h is not None, reg.disabled
    assert view.is_pinned() and mf.raw(len(data) - 3, 3).is_pinned()  # cudaPointerGetAttributes sees it
    dst = torch.empty(len(data), dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        dst.copy_(view, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
    done.synchronize()
    reg.release(h)  # only once the copy has completed: torch keeps nothing alive for a foreign pointer
    assert dst.cpu().numpy().tobytes() == data
    st = reg.stats()
    assert st.registered_bytes == 0 and st.registrations == st.unregistrations == len(h.tiles) >= 2
    assert not view.is_pinned()  # unregistered
    reg.close()
    reg.close()
    assert reg.disabled == "closed"


def test_kept_tiles_stay_registered_and_close_unregisters_them(shard):
    mf, data = shard
    lo = mf.address()
    reg = HostRegistry(len(data) + PAGE, _driver(), window_bytes=1 << 20, keep=True)
    for _ in range(2):
        h = reg.acquire(lo, len(data), (lo, lo + len(data)))
        dst = mf.raw(0, len(data)).to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        reg.release(h)
        assert dst.cpu().numpy().tobytes() == data
    assert reg.stats().registrations == len(h.tiles)  # the second load registered nothing
    assert mf.raw(0, 1).is_pinned()
    reg.forget((lo, lo + len(data)))
    assert not mf.raw(0, 1).is_pinned() and reg.stats().registered_bytes == 0
    reg.close()


def test_a_refusal_disables_the_registry_and_leaves_cuda_usable(shard):
    mf, data = shard
    lo = mf.address()
    driver = _driver()
    driver.register(lo, PAGE)  # registered behind the registry's back: its own registration must be refused
    try:
        reg = HostRegistry(len(data) + PAGE, driver, window_bytes=1 << 20)
        assert reg.acquire(lo, PAGE, (lo, lo + len(data))) is None
        assert "refused" in reg.disabled
        x = torch.ones(1 << 10, device="cuda") * 2  # a kernel launch: no stale error from the refusal
        torch.cuda.synchronize()
        assert x.sum().item() == 2048
        reg.close()
    finally:
        driver.unregister(lo)
