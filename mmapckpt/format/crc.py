"""The format's checksum: CRC-32 (zlib's polynomial and conventions, docs/format.md 2.4), computed fast.

Every CRC-32 mmapckpt computes or checks goes through :func:`crc32`. It gives the value
``zlib.crc32`` gives for the same bytes and start value (the format does not change); large
buffers go to zlib-ng's implementation (the ``zlib-ng`` package, a dependency), which folds with
carry-less multiplies (PCLMULQDQ/VPCLMULQDQ on x86, PMULL on Arm). On the development VM (AMD
EPYC, 256 MiB buffers) it ran at 14-19 GB/s against 1.9-3.5 GB/s for the standard library's
zlib 1.2.13, which made the CRC-32 the slowest step of a save (the copy into the bounce buffers
runs at 5-6 GB/s, an O_DIRECT write at 2.5 GB/s). Both release the GIL.

Buffers under :data:`SMALL` (headers, metadata bodies, small entries) stay with the standard
library's zlib, so a load that checks only headers does not import zlib-ng (its module imports
``gzip``); where zlib-ng cannot be imported, every buffer does.
"""

from __future__ import annotations

import zlib
from typing import Any, Callable

__all__ = ["crc32", "SMALL"]

#: Buffers shorter than this are checksummed by the standard library's zlib.
SMALL = 1 << 16

_fast: Callable[..., int] | None = None  # found on the first large buffer


def _fast_crc32() -> Callable[..., int]:
    global _fast
    try:
        from zlib_ng.zlib_ng import crc32 as fast
    except ImportError:  # a platform zlib-ng has no wheel for: the standard library's zlib, slower
        fast = zlib.crc32
    _fast = fast
    return fast


def crc32(data: Any, value: int = 0) -> int:
    """``zlib.crc32(data, value)``: the CRC-32 of the C-contiguous buffer ``data``, continuing from ``value``."""
    n = len(data) if type(data) is bytes else memoryview(data).nbytes
    if n < SMALL:
        return zlib.crc32(data, value)
    return (_fast or _fast_crc32())(data, value)
