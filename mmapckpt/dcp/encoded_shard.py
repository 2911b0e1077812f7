"""Writing a shard whose items go through DCP stream transforms (``MmapWriter(_extensions=...)``).

An encoded item's stored length is known only once it has been written, so the header
space is reserved first (sized for the widest offsets and lengths), the items are encoded
one after another behind it, each at a 64-byte boundary, and the header is written last.
Writes are buffered (no O_DIRECT): the encoded bytes come in pieces of any length.
"""

from __future__ import annotations

import zlib
from typing import Any

from torch.distributed.checkpoint.planner import SavePlanner, WriteItem, WriteItemType

from ..format import layout as fmt
from ..format.transforms import StreamTransforms
from ..io.d2h import stage_to_host
from ..storage.base import FileOutput

__all__ = ["write_encoded_entries"]

_WIDEST = 10**19  # more digits than any offset or length (< 2**63) has


def _entry(it: WriteItem, descriptors: tuple[str, ...], offset: int, length: int, crc: int) -> fmt.Entry:
    if it.type == WriteItemType.BYTE_IO:
        return fmt.Entry(it.index.fqn, None, fmt.KIND_ENCODED, None, (), offset, length, crc, descriptors)
    td = it.tensor_data
    return fmt.Entry(it.index.fqn, tuple(td.chunk.offsets), fmt.KIND_ENCODED, fmt.dtype_name(td.properties.dtype),
                     tuple(td.chunk.sizes), offset, length, crc, descriptors)


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
        self.crc = zlib.crc32(mv, self.crc)


def write_encoded_entries(out: FileOutput, items: list[WriteItem], byte_payloads: dict[Any, bytes], planner: SavePlanner,
                          transforms: StreamTransforms, save_id: str | None,
                          tensor_bytes: Any) -> list[fmt.Entry]:
    """Encode every item behind a reserved header, then finish the file with the header; return the entries
    in item order.

    ``tensor_bytes(entry_spec_item, tensor)`` gives a resolved tensor's bytes after checking it
    against the plan (shard_writer's check, shared).
    """
    descriptors = transforms.descriptors
    reserve = fmt.encode_header([_entry(it, descriptors, _WIDEST, _WIDEST, 0) for it in items], save_id)
    sink = _Appender(out, len(reserve))
    staged = iter(stage_to_host([it for it in items if it.type != WriteItemType.BYTE_IO], planner.resolve_data))
    done = []
    for it in items:
        if it.type == WriteItemType.BYTE_IO:
            data: Any = byte_payloads[it.index]
        else:
            sit, t = next(staged)
            assert sit is it  # stage_to_host yields in order (an invariant of ours, not file content)
            data = tensor_bytes(it, t)
        offset = sink.start()
        transforms.encode([data], sink.put)
        done.append(_entry(it, descriptors, offset, sink.length, sink.crc))
    header = fmt.encode_header(done, save_id)
    assert len(header) <= len(reserve)  # the widest placeholders bound every real header
    out.finish(header + bytes(len(reserve) - len(header)))
    return done
