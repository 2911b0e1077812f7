"""The host-registration registry's bookkeeping on the CPU, over real mappings of small files.

RecordingDriver enforces the CUDA driver's rules (whole pages, no overlap, unregister only
what is registered, nothing after close, ranges inside a live mapping); the real
cudaHostRegister runs in tests/gpu/test_cuda_register.py.
"""

from __future__ import annotations

import os
import random
import threading

import pytest

from mmapckpt.io.host_register import PAGE, HostRegisterError, HostRegistry, RecordingDriver
from mmapckpt.io.mapped import MappedFile, open_regular

W = 4 * PAGE  # a window of 4 pages


class Mapping:
    """A real MappedFile of ``size`` bytes, declared live to the driver."""

    def __init__(self, tmp_path, name: str, size: int, driver: RecordingDriver) -> None:
        path = tmp_path / name
        path.write_bytes(os.urandom(size))
        fd = open_regular(str(path))
        self.mf = MappedFile(fd, str(path))
        os.close(fd)
        self.lo, self.hi = self.mf.address(), self.mf.address() + size
        self.bounds = (self.lo, self.hi)
        self.driver = driver
        driver.mapped(self.lo, self.hi)

    def close(self) -> None:
        self.driver.unmapped(self.lo)  # checks nothing registered in it is left


@pytest.fixture
def driver():
    d = RecordingDriver()
    yield d
    assert d.violations == []


def _tiles_of(m: Mapping, off: int, n: int) -> list[tuple[int, int]]:
    """The tiles expected for [off, off+n) of m, computed independently of the registry."""
    hi = -(-m.hi // PAGE) * PAGE
    out = []
    for k in range((m.lo + off) // W, (m.lo + off + n - 1) // W + 1):
        out.append((max(k * W, m.lo), min((k + 1) * W, hi)))
    return out


def test_tiles_are_window_aligned_clipped_to_the_mapping_and_whole_pages(tmp_path, driver):
    m = Mapping(tmp_path, "a", 10 * PAGE + 100, driver)  # the last page is partial
    reg = HostRegistry(1 << 30, driver, window_bytes=W)
    h = reg.acquire(m.lo + 3, m.hi - m.lo - 3, m.bounds)
    assert list(h.tiles) == _tiles_of(m, 3, m.hi - m.lo - 3)
    assert sorted(driver.registered.items()) == [(s, e - s) for s, e in h.tiles]
    assert driver.covers(m.lo, m.hi - m.lo)
    assert h.tiles[-1][1] == m.lo + 11 * PAGE  # the partial page is registered whole
    assert all(s % W == 0 for s, _ in h.tiles[1:]) and all(e % W == 0 for _, e in h.tiles[:-1])
    reg.release(h)
    assert driver.registered == {}
    empty = reg.acquire(m.lo + 5, 0, m.bounds)
    assert empty is not None and empty.tiles == () and driver.registered == {}
    reg.release(empty)
    reg.close()
    m.close()


def test_a_range_outside_its_mapping_is_refused(tmp_path, driver):
    m = Mapping(tmp_path, "a", 3 * PAGE, driver)
    reg = HostRegistry(1 << 30, driver, window_bytes=W)
    with pytest.raises(ValueError, match="not inside"):
        reg.acquire(m.lo + PAGE, 3 * PAGE, m.bounds)
    with pytest.raises(ValueError, match="not inside"):
        reg.acquire(m.lo + 1, 10, (m.lo + 1, m.hi))
    assert driver.calls == []


def test_tiles_are_shared_and_counted(tmp_path, driver):
    m = Mapping(tmp_path, "a", 12 * PAGE, driver)
    reg = HostRegistry(1 << 30, driver, window_bytes=W)
    a = reg.acquire(m.lo, 6 * PAGE, m.bounds)           # tiles 0, 1
    b = reg.acquire(m.lo + 5 * PAGE, 6 * PAGE, m.bounds)  # tiles 1, 2: tile 1 shared
    assert reg.stats().registrations == len({*a.tiles, *b.tiles}) == len(driver.registered)
    reg.release(a)
    assert driver.covers(b.ptr, b.nbytes)  # the shared tile outlives its first user
    assert not driver.covers(m.lo, PAGE)   # the tile only a used is gone at once
    with pytest.raises(ValueError, match="released already"):
        reg.release(a)
    reg.release(b)
    st = reg.stats()
    assert driver.registered == {} and st.registered_bytes == 0 and st.unregistrations == st.registrations
    assert st.peak_bytes == sum(e - s for s, e in {*a.tiles, *b.tiles})
    reg.close()
    m.close()


def test_the_budget_bounds_registered_bytes(tmp_path, driver):
    m = Mapping(tmp_path, "a", 32 * PAGE, driver)
    w0 = _tiles_of(m, 0, 1)[0]
    first = w0[1] - w0[0]                  # the first tile may be short (the mapping is not window-aligned)
    reg = HostRegistry(first + W, driver, window_bytes=W)
    assert reg.acquire(m.lo, 16 * PAGE, m.bounds) is None      # more tiles than the budget allows
    a = reg.acquire(m.lo, first + 1, m.bounds)                  # two tiles: the whole budget
    assert a is not None and len(a.tiles) == 2
    assert reg.acquire(m.lo + first + W, 1, m.bounds) is None   # a third: refused while a holds two
    again = reg.acquire(m.lo, 1, m.bounds)                      # a registered tile costs nothing
    assert again is not None
    reg.release(a)
    reg.release(again)
    c = reg.acquire(m.lo + first + W, 1, m.bounds)
    assert c is not None
    st = reg.stats()
    assert st.refused == 2 and st.peak_bytes <= first + W
    reg.close()
    m.close()


def test_keep_mode_retains_idle_tiles_and_evicts_the_least_recently_used(tmp_path, driver):
    m = Mapping(tmp_path, "a", 64 * PAGE, driver)
    t = [s for s in _tiles_of(m, 0, 64 * PAGE) if s[1] - s[0] == W]  # full tiles only
    reg = HostRegistry(2 * W, driver, window_bytes=W, keep=True)
    for s, _ in t[:2]:
        reg.release(reg.acquire(s, W, m.bounds))
    assert sorted(driver.registered) == [t[0][0], t[1][0]]  # kept after release
    reg.release(reg.acquire(t[0][0], W, m.bounds))          # reuse: t0 is now the most recent
    assert reg.stats().registrations == 2
    reg.release(reg.acquire(t[2][0], W, m.bounds))          # room is made by evicting t1, the oldest
    assert sorted(driver.registered) == [t[0][0], t[2][0]]
    held = reg.acquire(t[0][0], W, m.bounds)
    assert reg.acquire(t[3][0], 2 * W, m.bounds) is None     # t0 is in use: it cannot be evicted
    reg.release(held)
    reg.close()
    assert driver.registered == {}
    m.close()


def test_forget_unregisters_a_mapping_before_it_closes(tmp_path, driver):
    a = Mapping(tmp_path, "a", 9 * PAGE, driver)
    b = Mapping(tmp_path, "b", 9 * PAGE, driver)
    reg = HostRegistry(1 << 30, driver, window_bytes=W, keep=True)
    ha = reg.acquire(a.lo, 9 * PAGE, a.bounds)
    reg.release(reg.acquire(b.lo, 9 * PAGE, b.bounds))
    reg.forget(a.bounds)
    a.close()                                    # the driver checks nothing of a is registered
    assert driver.covers(b.lo, 9 * PAGE)         # b's kept tiles are untouched
    reg.release(ha)                              # a forgotten handle releases to nothing
    assert reg.stats().registered_bytes == sum(driver.registered.values())
    reg.close()
    b.close()


def test_a_tile_left_from_a_closed_mapping_is_detected(tmp_path, driver):
    m = Mapping(tmp_path, "a", 8 * PAGE, driver)
    reg = HostRegistry(1 << 30, driver, window_bytes=W, keep=True)
    reg.release(reg.acquire(m.lo, 8 * PAGE, m.bounds))
    # a new mapping at an address inside the old one's kept tiles (the old one not forgotten)
    with pytest.raises(ValueError, match="forget"):
        reg.acquire(m.lo + PAGE, PAGE, (m.lo + PAGE, m.hi))
    reg.close()
    m.close()


def test_a_refusing_driver_disables_the_registry_without_breaking_held_ranges(tmp_path):
    driver = RecordingDriver(refuse_after=2)
    m = Mapping(tmp_path, "a", 16 * PAGE, driver)
    reg = HostRegistry(1 << 30, driver, window_bytes=W, keep=True)
    t = _tiles_of(m, 0, 16 * PAGE)
    held = reg.acquire(m.lo, 1, m.bounds)
    reg.release(reg.acquire(t[1][0], 1, m.bounds))   # kept idle
    assert reg.acquire(t[2][0], 2 * W, m.bounds) is None     # the third registration is refused
    assert "refused" in reg.disabled and "out of memory" in reg.disabled
    assert sorted(driver.registered) == [t[0][0]]            # idle tiles dropped; the held one stays
    assert reg.acquire(m.lo, 1, m.bounds) is None            # disabled: nothing more, even registered tiles
    reg.release(held)
    assert driver.registered == {} and reg.stats().disabled == reg.disabled
    reg.close()
    assert "refused" in reg.disabled  # the first reason is kept
    m.close()
    assert driver.violations == []


def test_a_refused_unregistration_disables_the_registry(tmp_path, driver):
    class Refuses(RecordingDriver):
        def unregister(self, ptr):
            super().unregister(ptr)
            raise HostRegisterError("cudaHostUnregister refused: invalid argument (1)", 1)

    d = Refuses()
    m = Mapping(tmp_path, "a", 4 * PAGE, d)
    reg = HostRegistry(1 << 30, d, window_bytes=W)
    reg.release(reg.acquire(m.lo, PAGE, m.bounds))
    assert "unregistration refused" in reg.disabled and reg.acquire(m.lo, PAGE, m.bounds) is None
    assert reg.stats().registered_bytes == 0
    reg.close()


def test_a_refusal_while_forgetting_kept_tiles_leaves_consistent_books(tmp_path, driver):
    class RefusesOnce(RecordingDriver):
        refused = False

        def unregister(self, ptr):
            super().unregister(ptr)
            if not self.refused:
                self.refused = True
                raise HostRegisterError("cudaHostUnregister refused: invalid argument (1)", 1)

    d = RefusesOnce()
    m = Mapping(tmp_path, "a", 16 * PAGE, d)
    reg = HostRegistry(1 << 30, d, window_bytes=W, keep=True)
    for s, _ in _tiles_of(m, 0, 16 * PAGE):
        reg.release(reg.acquire(s, PAGE, m.bounds))   # several idle tiles
    reg.forget(m.bounds)                              # the first refusal drops the other idle tiles meanwhile
    assert "unregistration refused" in reg.disabled
    assert d.registered == {} and reg.stats().registered_bytes == 0 and d.violations == []
    m.close()
    reg.close()


def test_close_unregisters_everything_and_is_idempotent(tmp_path, driver):
    m = Mapping(tmp_path, "a", 12 * PAGE, driver)
    reg = HostRegistry(1 << 30, driver, window_bytes=W, keep=True)
    held = reg.acquire(m.lo, 5 * PAGE, m.bounds)
    reg.release(reg.acquire(m.lo + 8 * PAGE, PAGE, m.bounds))
    reg.close()
    driver.close()                       # the driver now refuses any registration as a bug
    reg.close()
    assert reg.disabled == "closed" and reg.acquire(m.lo, PAGE, m.bounds) is None
    reg.release(held)                    # a copy's release after close changes nothing
    st = reg.stats()
    assert st.registered_bytes == 0 and st.unregistrations == st.registrations == 3
    m.close()


@pytest.mark.parametrize("keep", [False, True])
def test_threads_acquiring_and_releasing_keep_every_invariant(tmp_path, driver, keep):
    """4 threads acquire and release random ranges of 3 mappings; checked against a model."""
    maps = [Mapping(tmp_path, f"m{i}", n, driver) for i, n in enumerate((37 * PAGE + 11, 20 * PAGE, 5 * PAGE))]
    budget = 12 * W
    reg = HostRegistry(budget, driver, window_bytes=W, keep=keep)
    errors: list[BaseException] = []
    granted = [0]
    count_lock = threading.Lock()

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        held = []
        try:
            for _ in range(300):
                if held and (rng.random() < 0.5 or len(held) > 3):
                    h = held.pop(rng.randrange(len(held)))
                    assert driver.covers(h.ptr, h.nbytes), "a held range lost its registration"
                    reg.release(h)
                    continue
                m = rng.choice(maps)
                off = rng.randrange(m.hi - m.lo)
                n = rng.randrange(0, min(m.hi - m.lo - off, 3 * W) + 1)
                h = reg.acquire(m.lo + off, n, m.bounds)
                assert reg.stats().registered_bytes <= budget
                if h is not None:
                    assert driver.covers(h.ptr, h.nbytes), "an acquired range is not registered"
                    held.append(h)
                    with count_lock:
                        granted[0] += 1
            for h in held:
                reg.release(h)
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and driver.violations == []
    st = reg.stats()
    assert granted[0] > 100 and st.peak_bytes <= budget
    assert st.registered_bytes == sum(driver.registered.values())
    assert st.registrations - st.unregistrations == len(driver.registered)
    if not keep:
        assert driver.registered == {}
    for m in maps[:2]:
        reg.forget(m.bounds)
        m.close()
    reg.close()
    driver.close()
    maps[2].close()
    assert driver.registered == {} and reg.stats().registered_bytes == 0
