"""What a cached copy is checked against before it becomes visible: the CRC-32s of an mmapckpt shard.

An mmapckpt shard (it starts with the format's magic) is checked as ``verify`` checks it: its
preamble and header (the header's own CRC-32, every entry inside the file), then the CRC-32 of
every entry's bytes against the header. Any other file (a stock DCP shard, a safetensors file, a
``.metadata``, an index) has no checksum of its bytes: it is checked to be complete, every one of
the ``size`` bytes the store reported received (a short body fails the fetch itself), and its
version is the store's ETag, recorded beside it.
"""

from __future__ import annotations

import zlib
from typing import Any

from ...errors import ChecksumError
from ...format import layout

__all__ = ["check_copy", "CRC32", "SIZE"]

#: what a copy was checked against: every entry's CRC-32, or only its size
CRC32, SIZE = "crc32", "size"


def check_copy(data: Any, path: str) -> str:
    """Check the bytes ``data`` (a buffer of the whole file) fetched for ``path``; say how (:data:`CRC32` or
    :data:`SIZE`).

    Raises:
        ChecksumError: an entry's bytes do not match its CRC-32.
        FormatError (or a subclass): a shard whose preamble or header is damaged.
    """
    mv = memoryview(data).cast("B")
    if bytes(mv[:len(layout.MAGIC)]) != layout.MAGIC:
        return SIZE
    minor, order, hlen, hcrc = layout.decode_preamble(bytes(mv[:layout.PREAMBLE_SIZE]), len(mv), path)
    body = bytes(mv[layout.PREAMBLE_SIZE:layout.PREAMBLE_SIZE + hlen])
    header = layout.decode_header(body, header_crc=hcrc, byte_order=order, minor=minor, file_size=len(mv), path=path)
    for e in header.entries:
        got = zlib.crc32(mv[e.offset:e.offset + e.length]) if e.length else 0
        if got != e.crc32:
            raise ChecksumError(f"CRC-32 of the data fetched is {got:08x}, the header says {e.crc32:08x}: the copy "
                                "is not cached. Load again; if it repeats, the stored file itself is damaged "
                                "(`mmapckpt verify URL` without the cache)", path=path, entry=e.label)
    return CRC32
