"""A shard whose entries go through DCP stream transforms (``MmapWriter(_extensions=...)``).

An encoded entry's stored length is known only once it has been written, so the header
space is reserved first (sized for the widest offsets and lengths), the entries are encoded
one after another behind it, each at a 64-byte boundary, and the header is written last.
Writes are buffered (no O_DIRECT): the encoded bytes come in pieces of any length.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from ..format.crc import crc32
from ..format import layout as fmt
from ..format.transforms import StreamTransforms
from ..storage.base import FileOutput
from .tensors import entry_bytes

__all__ = ["write_encoded_entries"]

_WIDEST = 10**19  # more digits than any offset or length (< 2**63) has


def _entry(e: Any, descriptors: tuple[str, ...], offset: int, length: int, crc: int) -> fmt.Entry:
    return fmt.Entry(e.fqn, e.chunk_offsets, fmt.KIND_ENCODED, e.dtype, e.shape, offset, length, crc, descriptors)


class _Appender:
    """Pieces after the reserved header; keeps the running length and CRC-32 of one entry."""

    def __init__(self, out: FileOutput, pos: int) -> None:
        self.out, self.pos, self.length, self.crc = out, pos, 0, 0

    def start(self) -> int:
        pad = -self.pos % fmt.MIN_ALIGNMENT
        if pad:  # written, not left as a hole: an empty last entry still lies inside the file
            self.out.put(self.pos, bytes(pad))
            self.pos += pad
        self.length, self.crc = 0, 0
        return self.pos

    def put(self, mv: memoryview) -> None:
        self.out.put(self.pos, mv)
        self.pos += mv.nbytes
        self.length += mv.nbytes
        self.crc = crc32(mv, self.crc)


def write_encoded_entries(out: FileOutput, entries: Sequence[Any], resolve: Callable[[Any], Any],
                          transforms: StreamTransforms, save_id: str | None, at: Any) -> list[fmt.Entry]:
    """Encode every entry (writing/shard.py ``ShardEntry``) behind a reserved header, then finish the file with
    the header; return the written entries in input order. ``at.index`` follows the entry being written."""
    descriptors = transforms.descriptors
    reserve = fmt.encode_header([_entry(e, descriptors, _WIDEST, _WIDEST, 0) for e in entries], save_id)
    sink = _Appender(out, len(reserve))
    done = []
    for i, data in entry_bytes(entries, range(len(entries)), resolve, at):
        offset = sink.start()
        transforms.encode([data], sink.put)
        done.append(_entry(entries[i], descriptors, offset, sink.length, sink.crc))
    header = fmt.encode_header(done, save_id)
    assert len(header) <= len(reserve)  # the widest placeholders bound every real header
    out.finish(header + bytes(len(reserve) - len(header)))
    return done
