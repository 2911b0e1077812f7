"""DCP plan items for a whole chunk (and write results), built directly: what the fast planners hand to DCP.

DCP's ``MetadataIndex``, ``ReadItem``, ``WriteItem`` and ``TensorWriteData`` are frozen
dataclasses: their constructors set each field through ``object.__setattr__`` and
``MetadataIndex`` copies its offsets into a new ``torch.Size``, about 4 us for one
``ReadItem`` and its two indexes (``WriteResult``, which MmapWriter returns per item, too). The builders here fill the instance dict instead
(0.3 us an index), with the very values and types the constructors would store:
offsets and sizes are ``torch.Size`` objects (shared, as immutable values may be), so
the items equal, hash and pickle as constructed ones. Where a torch version makes these
classes something else (slots, other fields), ``DIRECT`` is False and the constructors
run. ``tests/dcp/test_plan_items.py`` compares both ways field by field.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    ReadItem,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import WriteResult

__all__ = ["DIRECT", "metadata_index", "read_item", "tensor_write_item", "whole_read_item", "write_item",
           "write_result", "zeros"]


def _fields_in_dict(cls: type, names: tuple[str, ...]) -> bool:
    """Whether ``cls`` is a dataclass of exactly these fields, kept in the instance dict."""
    return (dataclasses.is_dataclass(cls) and "__slots__" not in vars(cls)
            and tuple(f.name for f in dataclasses.fields(cls)) == names)


#: Whether this torch's item classes can be filled directly (else their constructors run).
DIRECT = (_fields_in_dict(MetadataIndex, ("fqn", "offset", "index"))
          and _fields_in_dict(ReadItem, ("type", "dest_index", "dest_offsets", "storage_index", "storage_offsets",
                                         "lengths"))
          and _fields_in_dict(WriteItem, ("index", "type", "bytes_io_data", "tensor_data"))
          and _fields_in_dict(TensorWriteData, ("chunk", "properties", "size"))
          and _fields_in_dict(WriteResult, ("index", "size_in_bytes", "storage_data")))

_new = object.__new__
_ZEROS: dict[int, torch.Size] = {}
_TENSOR = LoadItemType.TENSOR


def zeros(n: int) -> torch.Size:
    """``torch.Size([0] * n)``, one object per length."""
    z = _ZEROS.get(n)
    if z is None:
        z = _ZEROS[n] = torch.Size([0] * n)
    return z


def metadata_index(fqn: str, offset: torch.Size | None, index: int | None) -> MetadataIndex:
    """``MetadataIndex(fqn, offset, index)``; ``offset`` must already be a ``torch.Size`` (or None)."""
    if not DIRECT:
        return MetadataIndex(fqn, offset, index)
    mi = _new(MetadataIndex)
    d = mi.__dict__
    d["fqn"] = fqn
    d["offset"] = offset
    d["index"] = index
    return mi


def read_item(fqn: str, local_offsets: torch.Size, stored_offsets: torch.Size, stored_idx: int,
              sizes: torch.Size) -> ReadItem:
    """The item DCP's sweep makes for a local chunk that is exactly one stored chunk (all ``torch.Size``)."""
    z = zeros(len(sizes))
    if not DIRECT:
        return ReadItem(type=_TENSOR, dest_index=MetadataIndex(fqn, local_offsets, 0), dest_offsets=z,
                        storage_index=MetadataIndex(fqn, stored_offsets, stored_idx), storage_offsets=z,
                        lengths=torch.Size(sizes))
    return _tensor_read_item(metadata_index(fqn, local_offsets, 0), metadata_index(fqn, stored_offsets, stored_idx),
                             z, sizes)


def whole_read_item(fqn: str, sizes: torch.Size) -> ReadItem:
    """``read_item(fqn, z, z, 0, sizes)`` (``z`` all zeros): a whole tensor stored as one chunk at offset zero.

    Its ``dest_index`` and ``storage_index`` are equal values, so one ``MetadataIndex`` object
    (frozen, as immutable as the ``torch.Size`` objects shared here) serves as both: two
    objects built for the item, not three.
    """
    z = zeros(len(sizes))
    if not DIRECT:
        return read_item(fqn, z, z, 0, sizes)
    index = metadata_index(fqn, z, 0)
    return _tensor_read_item(index, index, z, sizes)


def _tensor_read_item(dest: MetadataIndex, storage: MetadataIndex, zero: torch.Size, sizes: torch.Size) -> ReadItem:
    """A tensor ``ReadItem`` from ``dest`` to ``storage``, both at offsets ``zero`` within them, built directly."""
    r = _new(ReadItem)
    d = r.__dict__
    d["type"] = _TENSOR
    d["dest_index"] = dest
    d["dest_offsets"] = zero
    d["storage_index"] = storage
    d["storage_offsets"] = zero
    d["lengths"] = sizes
    return r


def write_item(index: MetadataIndex, kind: WriteItemType, bytes_io_data: Any, tensor_data: Any) -> WriteItem:
    """``WriteItem(index, kind, bytes_io_data, tensor_data)``."""
    if not DIRECT:
        return WriteItem(index=index, type=kind, bytes_io_data=bytes_io_data, tensor_data=tensor_data)
    w = _new(WriteItem)
    d = w.__dict__
    d["index"] = index
    d["type"] = kind
    d["bytes_io_data"] = bytes_io_data
    d["tensor_data"] = tensor_data
    return w


def tensor_write_item(fqn: str, t: torch.Tensor, props: dict[tuple[Any, ...], TensorProperties],
                      index: int | None = None) -> WriteItem:
    """``_create_write_item_for_tensor(fqn, t)`` for a plain tensor, its properties shared through ``props``
    (``index``: the chunk index hint, which DCP's global plan sets to 0 for a whole tensor)."""
    size = t.size()
    z = zeros(len(size))
    key = (t.dtype, t.layout, t.requires_grad, t.is_pinned())
    p = props.get(key)
    if p is None:
        p = props[key] = TensorProperties(dtype=key[0], layout=key[1], requires_grad=key[2],
                                          memory_format=torch.contiguous_format, pin_memory=key[3])
    chunk = ChunkStorageMetadata(offsets=z, sizes=size)
    if not DIRECT:
        return WriteItem(index=MetadataIndex(fqn, z, index), type=WriteItemType.TENSOR,
                         tensor_data=TensorWriteData(chunk=chunk, properties=p, size=size))
    td = _new(TensorWriteData)
    d = td.__dict__
    d["chunk"] = chunk
    d["properties"] = p
    d["size"] = size
    return write_item(metadata_index(fqn, z, index), WriteItemType.TENSOR, None, td)


def write_result(index: MetadataIndex, size_in_bytes: int, storage_data: Any) -> WriteResult:
    """``WriteResult(index, size_in_bytes, storage_data)``."""
    if not DIRECT:
        return WriteResult(index=index, size_in_bytes=size_in_bytes, storage_data=storage_data)
    r = _new(WriteResult)
    d = r.__dict__
    d["index"] = index
    d["size_in_bytes"] = size_in_bytes
    d["storage_data"] = storage_data
    return r
