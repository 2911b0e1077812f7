"""MmapReader's reads of items stored through DCP stream transforms (``_extension_registry``).

Such items cannot be mapped: they are decoded into memory (straight into the target when a
whole chunk goes to a contiguous CPU target of its dtype), then narrowed and copied as a
mapped chunk is (read_paths.FileReads).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlanner, ReadItem

from ..errors import FormatError
from ..format.shard import Shard, encoded_bytes
from ..format.transforms import decoded_limit

if TYPE_CHECKING:
    from .read_paths import FileReads

__all__ = ["read_encoded", "stock_decode_limit"]


def _label(req: ReadItem) -> str:
    idx = req.storage_index
    return idx.fqn if idx.offset is None else f"{idx.fqn}@{list(idx.offset)}"


def _bytes_of(t: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's memory as writable bytes."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else memoryview(bytearray())


def read_encoded(reads: FileReads, shard: Shard, req: ReadItem, info: _StorageInfo, planner: LoadPlanner,
                 load_bytes: Callable[[LoadPlanner, ReadItem, bytes, str], None]) -> torch.device | None:
    """Read one encoded item of an mmapckpt shard into the planner's target (or hand its bytes on)."""
    idx, name = req.storage_index, _label(req)
    key = (idx.fqn, None if req.type == LoadItemType.BYTE_IO else tuple(idx.offset or ()))
    stored, descriptors = encoded_bytes(shard, key, info.offset, info.length)
    if list(descriptors) != list(info.transform_descriptors):
        raise FormatError(f"metadata says the item went through {list(info.transform_descriptors)}, the shard "
                          f"header says {list(descriptors)}", path=shard.path, entry=name)
    decode: Any = reads.transforms.decode
    if req.type == LoadItemType.BYTE_IO:
        load_bytes(planner, req, decode(stored, descriptors, path=shard.path, entry=name), shard.path)
        return None
    dtype, sizes = reads._chunk(idx, shard.path)
    target = planner.resolve_tensor(req).detach()
    whole = not any(req.storage_offsets) and tuple(req.lengths) == tuple(sizes)
    if (whole and not reads.stage_cpu and target.device.type == "cpu" and target.dtype == dtype
            and tuple(target.shape) == tuple(sizes) and target.is_contiguous() and target.numel()):
        decode(stored, descriptors, path=shard.path, entry=name, into=_bytes_of(target))
        planner.commit_tensor(req, target)
        return None
    buf = torch.empty(sizes, dtype=dtype)
    decode(stored, descriptors, path=shard.path, entry=name, into=_bytes_of(buf))
    return reads._copy(buf, req, planner, shard.path, target=target)


def stock_decode_limit(reads: FileReads, req: ReadItem) -> int:
    """The most bytes a transformed stock item may decode to: its chunk's bytes plus torch.save's framing."""
    stored = reads.storage_data[req.storage_index].length
    if req.type == LoadItemType.BYTE_IO:
        return decoded_limit(stored)
    dtype, sizes = reads._chunk(req.storage_index, reads.root)
    return sizes.numel() * torch._utils._element_size(dtype) + (16 << 20)
