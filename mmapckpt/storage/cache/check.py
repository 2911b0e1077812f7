"""What a cached copy is checked against before it becomes visible: the CRC-32s of an mmapckpt shard.

An mmapckpt shard (it starts with the format's magic) is checked as ``verify`` checks it: its
preamble and header (the header's own CRC-32, every entry inside the file), then the CRC-32 of
every entry's bytes against the header, computed window by window as the fetch brings them in
(:class:`Checker`). Any other file (a stock DCP shard, a safetensors file, a ``.metadata``, an
index) has no checksum of its bytes: it is checked to be complete, every one of the ``size``
bytes the store reported received (a short body fails the fetch itself), and its version is the
store's ETag, recorded beside it.
"""

from __future__ import annotations

import bisect
from typing import Any

from ...errors import ChecksumError
from ...format.crc import crc32
from ...format import layout

__all__ = ["Checker", "check_copy", "crc32_combine", "CRC32", "SIZE"]

#: what a copy was checked against: every entry's CRC-32, or only its size
CRC32, SIZE = "crc32", "size"


class Checker:
    """The check of one file's bytes, fed in order (:meth:`feed`) as they arrive.

    :meth:`needs` says how many leading bytes it must see before the rest (an mmapckpt shard's
    preamble and header); :meth:`start` takes them, :meth:`feed` each following range in order,
    :meth:`finish` says how the copy was checked or raises.
    """

    def __init__(self, path: str, size: int) -> None:
        self.path, self.size = path, size
        self.entries: list[layout.Entry] = []
        self.crcs: list[int] = []
        self._next = 0  # entries before this one are complete
        self._ends: list[int] = []  # each entry's end, in the entries' order (ascending: entries do not overlap)
        #: an mmapckpt shard (its header checked at start)
        self.shard = False
        self._checked = 0  # entries before this one are compared with the header (checked_to)

    def needs(self, head: Any) -> int:
        """Leading bytes the check needs, given the first bytes ``head``: the preamble and header of a shard."""
        mv = memoryview(head).cast("B")
        if bytes(mv[:len(layout.MAGIC)]) != layout.MAGIC or len(mv) < layout.PREAMBLE_SIZE:
            return min(len(mv), self.size)
        hlen = layout.decode_preamble(bytes(mv[:layout.PREAMBLE_SIZE]), self.size, self.path)[2]
        return layout.PREAMBLE_SIZE + hlen

    def start(self, head: Any) -> None:
        """Take the file's first bytes (at least :meth:`needs` of them), and check them as :meth:`feed` does."""
        mv = memoryview(head).cast("B")
        if bytes(mv[:len(layout.MAGIC)]) == layout.MAGIC:
            minor, order, hlen, hcrc = layout.decode_preamble(bytes(mv[:layout.PREAMBLE_SIZE]), self.size, self.path)
            body = bytes(mv[layout.PREAMBLE_SIZE:layout.PREAMBLE_SIZE + hlen])
            header = layout.decode_header(body, header_crc=hcrc, byte_order=order, minor=minor, file_size=self.size,
                                          path=self.path)
            self.entries = sorted((e for e in header.entries if e.length), key=lambda e: e.offset)
            self._ends = [e.offset + e.length for e in self.entries]
            self.crcs = [0] * len(self.entries)
            self.shard = True
        self.feed(0, mv)

    def feed(self, offset: int, data: Any) -> None:
        """Bytes ``[offset, offset + len(data))`` of the file, the range after the previous one."""
        mv = memoryview(data).cast("B")
        end = offset + len(mv)
        i = self._next
        while i < len(self.entries) and self.entries[i].offset < end:
            e = self.entries[i]
            lo, hi = max(e.offset, offset), min(e.offset + e.length, end)
            if lo < hi:
                self.crcs[i] = crc32(mv[lo - offset:hi - offset], self.crcs[i])
            if e.offset + e.length <= end and i == self._next:
                self._next += 1
            i += 1

    def part(self, offset: int, data: Any) -> list[tuple[int, int, int]]:
        """The CRC-32s of the entries' bytes within ``[offset, offset + len(data))``, each on its own:
        ``(entry index, CRC-32, length)``. Reads only the header: any thread may compute a range's parts while
        others are fetched; :meth:`add` then takes them in offset order."""
        mv = memoryview(data).cast("B")
        end = offset + len(mv)
        out = []
        i = bisect.bisect_right(self._ends, offset)  # the first entry ending after offset
        while i < len(self.entries) and self.entries[i].offset < end:
            e = self.entries[i]
            lo, hi = max(e.offset, offset), min(e.offset + e.length, end)
            if lo < hi:
                out.append((i, crc32(mv[lo - offset:hi - offset]), hi - lo))
            i += 1
        return out

    def add(self, parts: list[tuple[int, int, int]]) -> None:
        """Take the :meth:`part` of the range after the previous one (ranges in offset order)."""
        for i, crc, n in parts:
            self.crcs[i] = crc32_combine(self.crcs[i], crc, n)

    def checked_to(self, end: int) -> int:
        """Every byte before ``end`` taken (:meth:`start`, :meth:`add` in order): compare the entries complete by
        then with the header (raising as :meth:`finish` does) and say how far the file is checked: the bytes before
        the offset returned lie in checked entries or in none (an entry still incomplete at ``end`` starts there)."""
        while self._checked < len(self.entries) and self._ends[self._checked] <= end:
            self._compare(self._checked)
            self._checked += 1
        if self._checked < len(self.entries) and self.entries[self._checked].offset < end:
            return self.entries[self._checked].offset
        return end

    def _compare(self, i: int) -> None:
        e, got = self.entries[i], self.crcs[i]
        if got != e.crc32:
            raise ChecksumError(f"CRC-32 of the data fetched is {got:08x}, the header says {e.crc32:08x}: the "
                                "copy is not cached. Load again; if it repeats, the stored file itself is damaged "
                                "(`mmapckpt verify URL` without the cache)", path=self.path, entry=e.label)

    def finish(self) -> str:
        """:data:`CRC32` or :data:`SIZE`, once every byte was fed.

        Raises:
            ChecksumError: an entry's bytes do not match its CRC-32.
        """
        for i in range(len(self.entries)):
            self._compare(i)
        return CRC32 if self.shard else SIZE


def check_copy(data: Any, path: str) -> str:
    """Check the whole of a file's bytes ``data`` at once (:class:`Checker`); how it was checked.

    Raises:
        ChecksumError: an entry's bytes do not match its CRC-32.
        FormatError (or a subclass): a shard whose preamble or header is damaged.
    """
    mv = memoryview(data).cast("B")
    c = Checker(path, len(mv))
    c.start(mv)
    return c.finish()


def _times(matrix: list[int], vector: int) -> int:
    """A 32x32 matrix over GF(2) (its columns as integers) times a vector."""
    out, i = 0, 0
    while vector:
        if vector & 1:
            out ^= matrix[i]
        vector >>= 1
        i += 1
    return out


def _zero_operators() -> list[list[int]]:
    """``ops[k]``: what appending ``2**k`` zero bytes does to a CRC-32 (zlib's ``crc32_combine`` operators)."""
    one_bit = [0xEDB88320] + [1 << n for n in range(31)]  # one zero bit: the reflected polynomial
    op = one_bit
    for _ in range(3):  # eight zero bits: one zero byte
        op = [_times(op, op[n]) for n in range(32)]
    ops = [op]
    for _ in range(63):
        op = [_times(op, op[n]) for n in range(32)]
        ops.append(op)
    return ops


_OPS: list[list[int]] = []


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32 of ``A + B`` from ``crc1`` of ``A`` and ``crc2`` of ``B`` (``len2`` bytes), as zlib's
    ``crc32_combine`` (which Python's zlib does not expose): a few dozen small GF(2) products."""
    if not _OPS:
        _OPS.extend(_zero_operators())
    k = 0
    while len2:
        if len2 & 1:
            crc1 = _times(_OPS[k], crc1)
        len2 >>= 1
        k += 1
    return crc1 ^ crc2
