"""format/crc.py: the format's CRC-32 is zlib's, whichever implementation computes it."""

from __future__ import annotations

import array
import mmap
import subprocess
import sys
import zlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mmapckpt.format import crc


@settings(max_examples=60, deadline=None)
@given(data=st.binary(min_size=0, max_size=3 * crc.SMALL), start=st.integers(0, 2**32 - 1),
       cut=st.integers(0, 3 * crc.SMALL))
def test_equals_zlib_across_the_size_threshold(data: bytes, start: int, cut: int) -> None:
    data = data * (1 + crc.SMALL // max(1, len(data))) if data and cut % 2 else data  # some above SMALL
    assert crc.crc32(data, start) == zlib.crc32(data, start)
    cut = min(cut, len(data))
    # continued in two pieces, one either side of the threshold or not: the same value as in one
    assert crc.crc32(memoryview(data)[cut:], crc.crc32(memoryview(data)[:cut])) == zlib.crc32(data)


def test_buffer_kinds_are_measured_in_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A memoryview of 4-byte items, a numpy array, an mmap: each checksummed whole, and sent to the fast
    implementation by its size in bytes, not in items (a float32 array of SMALL / 4 items is SMALL bytes)."""
    fast: list[int] = []

    def recording(data, value=0):  # type: ignore[no-untyped-def]
        fast.append(memoryview(data).nbytes)
        return zlib.crc32(data, value)

    monkeypatch.setattr(crc, "_fast", recording)
    floats = array.array("f", range(crc.SMALL // 4 + 3))
    arr = np.arange(crc.SMALL, dtype=np.float32).reshape(64, -1)
    m = mmap.mmap(-1, 3 * crc.SMALL)
    m[:7] = b"payload"
    kinds = (memoryview(floats), arr, m, memoryview(arr).cast("B").cast("f", (64, crc.SMALL // 64)))
    for buf in kinds:
        assert crc.crc32(buf) == zlib.crc32(buf)
    assert fast == [memoryview(b).nbytes for b in kinds]
    assert crc.crc32(memoryview(floats)[:crc.SMALL // 4 - 1]) == zlib.crc32(memoryview(floats)[:crc.SMALL // 4 - 1])
    assert len(fast) == len(kinds)  # under SMALL bytes: the standard zlib
    with pytest.raises(BufferError):  # as zlib: a strided view is refused, not checksummed wrong
        crc.crc32(memoryview(floats)[::2])


def test_the_large_path_is_zlib_ngs_and_small_buffers_do_not_import_it() -> None:
    code = ("import sys; from mmapckpt.format import crc; crc.crc32(b'x' * (crc.SMALL - 1)); "
            "assert 'zlib_ng.zlib_ng' not in sys.modules; crc.crc32(b'x' * crc.SMALL); "
            "import zlib_ng.zlib_ng as z; assert crc._fast is z.crc32, crc._fast")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_without_zlib_ng_the_standard_zlib_gives_the_same_values() -> None:
    code = ("import sys, zlib; sys.modules['zlib_ng.zlib_ng'] = None; from mmapckpt.format import crc; "
            "b = bytes(range(256)) * 1024; assert crc.crc32(b, 5) == zlib.crc32(b, 5); "
            "assert crc._fast is zlib.crc32")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
