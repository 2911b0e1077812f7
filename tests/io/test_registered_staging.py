"""Registered copies in the staging pipeline, on the CPU: the bookkeeping the CUDA path relies on.

With a registry (io/host_register.py; on a GPU from ``MMAPCKPT_REGISTER_BYTES``), a staged load
copies views of a cached file's mapping straight from their registered pages instead of filling
a staging buffer first. Here the registry's driver is io/host_drivers.RecordingDriver (it
registers nothing and enforces the CUDA driver's rules) and the copies are CPU copies; the real
cudaHostRegister path runs in tests/gpu/test_cuda_register.py.
"""

from __future__ import annotations

import os
import threading

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import helpers
import mmapckpt
from helpers import seeded_tensor
from mmapckpt.io import direct_reads, staging
from mmapckpt.io.direct_reads import DirectReads
from mmapckpt.io.host_register import PAGE, HostRegistry, RecordingDriver
from mmapckpt.io.mapped import MappedFile, open_regular
from mmapckpt.io.staging import StagingPool

W = 16 * PAGE  # a 64 KiB window


class _Registries:
    """Every registry the pools of a load make, over one RecordingDriver."""

    def __init__(self, budget: int, refuse_after: int | None = None) -> None:
        self.driver = RecordingDriver(refuse_after, check_mapped=False)
        self.budget, self.made = budget, []

    def __call__(self, device: torch.device) -> HostRegistry:
        r = HostRegistry(self.budget, self.driver, window_bytes=W)
        self.made.append(r)
        return r


@pytest.fixture
def registered(monkeypatch):
    """Stage CPU targets, files probe as cached, every pool gets a registry (budget set by the test)."""
    monkeypatch.setattr(staging, "STAGE_CPU_TARGETS", True)
    monkeypatch.setattr(direct_reads, "is_cached", lambda fd, offsets: True)
    reports: list[dict] = []
    monkeypatch.setattr(staging, "STATS_HOOK", reports.append)

    def use(budget: int, refuse_after: int | None = None) -> tuple[_Registries, list[dict]]:
        regs = _Registries(budget, refuse_after)
        monkeypatch.setattr(staging, "registry_from_env", regs)
        return regs, reports
    return use


def _state_dict() -> dict[str, torch.Tensor]:
    return {"big": seeded_tensor("big", (100_000,), torch.float32),  # 400 KB: several windows
            "bf": seeded_tensor("bf", (3, 777), torch.bfloat16),
            "small": seeded_tensor("small", (5,), torch.int64),
            "empty": torch.empty(0, 4)}


def _load_into_checked(tmp_path, sd: dict[str, torch.Tensor], reports: list[dict]) -> dict:
    """Save ``sd``, load it back into zeroed CPU targets through 8 KiB x 2 staging, check it bitwise; the pool's
    report."""
    mmapckpt.save(sd, tmp_path / "c")
    out = {k: torch.zeros_like(v) for k, v in sd.items()}
    mmapckpt.load_into(out, tmp_path / "c", staging_bytes=8192, staging_buffers=2)
    helpers.assert_tree_equal(out, sd)
    (r,) = reports
    return r


@pytest.mark.parametrize("how", ["load_into", "dcp"])
def test_a_cached_file_is_copied_from_its_registered_pages_bitwise(tmp_path, registered, how):
    """Every stored byte comes from registered pages (no staging fill), within the budget, all of it released
    and unregistered by the end of the load."""
    regs, reports = registered(4 * W)
    sd = _state_dict()
    out = {k: torch.zeros_like(v) for k, v in sd.items()}
    if how == "load_into":
        mmapckpt.save(sd, tmp_path / "c")
        mmapckpt.load_into(out, tmp_path / "c", staging_bytes=8192, staging_buffers=2)
    else:
        helpers.dcp_save(sd, mmapckpt.MmapWriter(tmp_path / "c"))
        reader = mmapckpt.MmapReader(tmp_path / "c", staging_bytes=8192, staging_buffers=2)
        reader._stage_cpu_targets = True
        helpers.dcp_load(out, reader)
        reader.close()
    helpers.assert_tree_equal(out, sd)
    (r,) = reports
    assert r["registered_bytes"] == sum(v.nbytes for v in sd.values())
    assert r["buffers"] >= 1 and r["registrations"] >= 400_000 // W  # the big tensor took several windows
    assert 0 < r["register_peak_bytes"] <= 4 * W
    assert regs.driver.registered == {} and regs.driver.violations == []


def test_a_window_is_released_only_after_the_copies_reading_it(tmp_path):
    """The registered view rides on the current buffer: while that buffer's (blocked) fill has not run, the
    copy has not happened and its window stays registered; once the buffer settles, it is unregistered."""
    data = seeded_tensor("d", (W // 4,), torch.float32)
    path = tmp_path / "f"
    path.write_bytes(data.numpy().tobytes())
    fd = open_regular(str(path))
    mf = MappedFile(fd, str(path))
    os.close(fd)
    driver = RecordingDriver()
    driver.mapped(mf.address(), mf.address() + mf.size)
    pool = StagingPool("cpu", staging_bytes=4096, staging_buffers=2, registry=HostRegistry(2 * W, driver,
                                                                                             window_bytes=W))
    gate, entered = threading.Event(), threading.Event()

    def blocked_read(staged: torch.Tensor, start: int, nbytes: int) -> None:
        entered.set()
        assert gate.wait(10)
        staged.fill_(7)

    first, out = torch.zeros(16, dtype=torch.uint8), torch.zeros_like(data)
    view = mf.view(0, torch.float32, (W // 4,))
    with pool:
        pool.copy(torch.empty(16, dtype=torch.uint8), first, read=blocked_read)
        pool.copy(view, out, mapping=(mf.address(), mf.address() + mf.size))
        assert driver.covers(view.data_ptr(), view.nbytes)
        t = threading.Thread(target=pool.seal)  # the buffer goes to the filler, which blocks in the read
        t.start()
        assert entered.wait(10)
        assert not out.any() and driver.covers(view.data_ptr(), view.nbytes)
        gate.set()
        t.join(10)
    helpers.assert_bitwise_equal(out, data)
    assert bool((first == 7).all())
    assert driver.registered == {} and driver.violations == []
    pool.close()
    del view
    driver.unmapped(mf.address())


def test_over_the_budget_the_oldest_buffer_is_waited_for_then_its_windows_reused(tmp_path, registered):
    """A budget of two windows (a block may straddle two) serves a file of many: the caller waits for older
    buffers' copies, whose windows are then unregistered; the peak stays within the budget."""
    regs, reports = registered(2 * W)
    sd = {f"t{i}": seeded_tensor(f"t{i}", (W // 4,), torch.float32) for i in range(6)}  # 6 windows of bytes
    mmapckpt.save(sd, tmp_path / "c")
    out = {k: torch.zeros_like(v) for k, v in sd.items()}
    mmapckpt.load_into(out, tmp_path / "c", staging_bytes=4096, staging_buffers=3)
    helpers.assert_tree_equal(out, sd)
    (r,) = reports
    assert r["registered_bytes"] == 6 * W and r["register_peak_bytes"] <= 2 * W and r["registrations"] >= 6
    assert r["wait_s"] > 0 and regs.driver.registered == {} and regs.driver.violations == []


def test_a_refusing_driver_falls_back_to_staging(tmp_path, registered):
    """The driver refuses after two registrations: the registry disables itself and the rest is staged,
    bitwise the same."""
    regs, reports = registered(8 * W, refuse_after=2)
    sd = _state_dict()
    r = _load_into_checked(tmp_path, sd, reports)
    assert 0 < r["registered_bytes"] < sum(v.nbytes for v in sd.values()) and r["fill_s"] > 0
    assert regs.made[0].disabled and regs.driver.registered == {}


def test_a_cold_file_is_staged_not_registered(tmp_path, registered, monkeypatch):
    """Registering a cold file's pages would read it by page faults: cold files go through the buffers."""
    regs, reports = registered(8 * W)
    monkeypatch.setattr(direct_reads, "is_cached", lambda fd, offsets: False)
    sd = _state_dict()
    r = _load_into_checked(tmp_path, sd, reports)
    assert r["registered_bytes"] == 0 and r["registrations"] == 0 and r["buffers"] > 1


def test_the_environment_variable_turns_registration_on_only_for_cuda(monkeypatch):
    from mmapckpt.io.host_register import REGISTER_ENV, registry_from_env

    monkeypatch.setenv(REGISTER_ENV, "1GiB")
    assert registry_from_env(torch.device("cpu")) is None
    monkeypatch.setenv(REGISTER_ENV, "lots")
    with pytest.raises(ValueError, match=REGISTER_ENV):
        registry_from_env(torch.device("cuda"))
    monkeypatch.setenv(REGISTER_ENV, "0")
    assert registry_from_env(torch.device("cuda")) is None
    if not torch.cuda.is_available():  # the driver cannot be had: a warning, and the pool stages
        monkeypatch.setenv(REGISTER_ENV, "1GiB")
        with pytest.warns(RuntimeWarning, match="cannot be registered"):
            assert registry_from_env(torch.device("cuda")) is None


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sizes=st.lists(st.integers(0, 9 * W // 4), min_size=1, max_size=8), windows=st.integers(1, 4),
       staging_kib=st.sampled_from([4, 16]), buffers=st.integers(1, 3), read=st.booleans(),
       refuse_after=st.one_of(st.none(), st.integers(0, 6)), seed=st.integers(0, 2**16))
def test_any_mix_of_registered_and_staged_copies_lands_bitwise(tmp_path_factory, sizes, windows, staging_kib,
                                                               buffers, read, refuse_after, seed):
    """Tensors of 0 bytes to over two windows, in one mapped file, through a pool whose registry holds 1 to 4
    windows (a block may straddle two) and whose driver may refuse: every byte lands, each ``done`` runs once
    with its target complete, never more than the budget registered, nothing left registered, and the
    driver's rules kept; with ``read``, the pieces staged instead of registered are read from the file at
    their own place."""
    tmp = tmp_path_factory.mktemp("mix")
    g = torch.Generator().manual_seed(seed)
    blob = torch.randint(0, 256, (sum(sizes) * 4 + 64,), dtype=torch.uint8, generator=g)
    (tmp / "f").write_bytes(blob.numpy().tobytes())
    fd = open_regular(str(tmp / "f"))
    mf = MappedFile(fd, str(tmp / "f"))
    driver = RecordingDriver(refuse_after)
    driver.mapped(mf.address(), mf.address() + mf.size)
    registry = HostRegistry(windows * W, driver, window_bytes=W)
    pool = StagingPool("cpu", staging_bytes=staging_kib << 10, staging_buffers=buffers, registry=registry)
    reads = DirectReads(mf, ranges=[(0, mf.size)]) if read else None
    bounds = (mf.address(), mf.address() + mf.size)
    pairs, calls, at = [], [], 0
    try:
        with pool:
            for k, n in enumerate(sizes):
                src = mf.view(at, torch.float32, (n,))
                dst = torch.zeros(n, dtype=torch.float32)
                at += n * 4

                def done(k=k, src=src, dst=dst):
                    assert helpers.tensor_bytes(dst) == helpers.tensor_bytes(src), f"item {k} committed incomplete"
                    calls.append(k)

                pool.copy(src, dst, done=done, mapping=bounds,
                          read=reads.reader_for(src, f"t{k}") if reads is not None and n else None)
                pairs.append((src, dst))
                assert registry.stats().registered_bytes <= windows * W
            pool.seal()
    finally:
        if reads is not None:
            reads.close()
        os.close(fd)
    pool.close()
    assert sorted(calls) == list(range(len(sizes)))
    for src, dst in pairs:
        helpers.assert_bitwise_equal(dst, src)
    assert registry.stats().peak_bytes <= windows * W
    assert driver.registered == {} and driver.violations == []
    del pairs, src
    driver.unmapped(mf.address())
