"""io/files.py ``advise_unlocked``: madvise of a mapping's pages through libc, the GIL released (the cache's fetch
populates each window's pages with it, storage/cache/entry.py)."""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path

import pytest

from mmapckpt.io import files
from mmapckpt.io.files import MADV_POPULATE_WRITE, advise_unlocked
from mmapckpt.storage.cache import entry

_PAGE = mmap.PAGESIZE


def _resident(mm: mmap.mmap) -> list[bool]:
    """Per page of ``mm``: whether it is mapped in (``mincore``)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    anchor = ctypes.c_char.from_buffer(mm)
    try:
        vec = (ctypes.c_ubyte * (len(mm) // _PAGE))()
        assert libc.mincore(ctypes.addressof(anchor), len(mm), vec) == 0, os.strerror(ctypes.get_errno())
    finally:
        del anchor
    return [bool(v & 1) for v in vec]


def _shared(path: Path, size: int) -> tuple[int, mmap.mmap]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    os.posix_fallocate(fd, 0, size)  # blocks reserved, no page in the page cache
    return fd, mmap.mmap(fd, size, flags=mmap.MAP_SHARED)


def test_populate_write_puts_in_the_pages_of_the_range_and_not_the_rest(tmp_path: Path) -> None:
    mib = 1 << 20
    fd, mm = _shared(tmp_path / "f", 64 * mib)
    try:
        if any(_resident(mm)):
            pytest.skip("this file system keeps a file's pages in memory from the start (tmpfs)")
        # from inside page 3 to inside page 9 (the page cache may hold the range in larger folios, so only far
        # pages are asked to stay out)
        if not advise_unlocked(mm, 3 * _PAGE + 100, 6 * _PAGE, MADV_POPULATE_WRITE):
            pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux 5.14)")
        resident = _resident(mm)
        assert all(resident[3:10]) and not any(resident[8 * mib // _PAGE:])
        assert bytes(mm[3 * _PAGE:10 * _PAGE]) == bytes(7 * _PAGE)  # populated pages of a reserved range read zero
        # a view of the mapping: offsets are the view's
        view = memoryview(mm)[32 * mib:]
        try:
            assert advise_unlocked(view, 16 * mib, _PAGE, MADV_POPULATE_WRITE)
        finally:
            view.release()
        resident = _resident(mm)
        assert resident[48 * mib // _PAGE] and not any(resident[8 * mib // _PAGE:40 * mib // _PAGE])
        assert not any(resident[56 * mib // _PAGE:])
    finally:
        mm.close()
        os.close(fd)


def test_refusals_do_nothing_and_say_so(tmp_path: Path) -> None:
    fd, mm = _shared(tmp_path / "f", 8 * _PAGE)
    try:
        # a file system that keeps a file's pages in memory from the start (tmpfs) cannot show "nothing done"
        resident_before = any(_resident(mm))
        assert not advise_unlocked(mm, 0, 0, MADV_POPULATE_WRITE)  # nothing to advise
        assert not advise_unlocked(mm, 8 * _PAGE, _PAGE, MADV_POPULATE_WRITE)  # outside the mapping
        assert not advise_unlocked(mm, 4 * _PAGE, 5 * _PAGE, MADV_POPULATE_WRITE)  # running past its end
        assert not advise_unlocked(mm, 0, _PAGE, 12345)  # advice the kernel does not know
        assert not advise_unlocked(b"read-only bytes", 0, 4, MADV_POPULATE_WRITE)  # no writable buffer
        if not resident_before:
            assert not any(_resident(mm))
    finally:
        mm.close()
        os.close(fd)


def test_the_call_releases_the_gil_and_the_cache_fetch_uses_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """ctypes releases the GIL around a foreign call unless the function is flagged as using Python's API (a
    ``PyDLL`` function); ``mmap.madvise`` holds it. The cache's fetch populates its windows through this call."""
    fn = files._libc_madvise()
    if not fn:
        pytest.skip("no libc madvise here")
    assert isinstance(fn, ctypes._CFuncPtr)
    assert not fn._flags_ & ctypes._FUNCFLAG_PYTHONAPI
    calls = []
    monkeypatch.setattr(entry, "advise_unlocked", lambda *a: calls.append(a[1:]) or True)
    fd, mm = _shared(tmp_path / "f", 16 * _PAGE)
    try:
        entry._populate(mm, 2 * _PAGE + 5, 7 * _PAGE)
    finally:
        mm.close()
        os.close(fd)
    assert calls == [(2 * _PAGE + 5, 5 * _PAGE - 5, MADV_POPULATE_WRITE)]
