"""Tied weights: names that are one tensor exactly, stored once and given back as one tensor.

Two names are an **exact alias** when they view the same storage at the same offset with
the same shape, strides, dtype and conj/neg bits (``lm_head.weight is embed.weight``). A
shard header then describes the same bytes under both names, with equal offset, length,
dtype, shape and CRC-32 (docs/format.md, 2.2 rule 6), and the metadata has one storage
record per name pointing at those bytes, so every reader that looks entries up by name
(``dcp.load`` with MmapReader, ``open``, ``load_into``, ``convert``, ``verify``) reads both.
Views that only overlap (a transpose, a slice, rows of a fused weight) are not aliases:
each is stored as its own logical values, as the format requires of every view.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from .entries import EntryInfo

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import MetadataIndex

__all__ = ["ALIASES_ATTR", "exact_aliases", "item_aliases", "position_aliases", "shared_names"]

#: A SavePlanner attribute, ``{alias MetadataIndex: canonical MetadataIndex}``, naming items
#: whose data is exactly another item's; the shard writer then stores their bytes once.
ALIASES_ATTR = "mmapckpt_aliases"


def _view_key(t: torch.Tensor) -> tuple[Any, ...] | None:
    """What makes two tensors the same values in the same memory; None where that cannot be told."""
    if t.numel() == 0 or t.device.type == "meta" or t.layout != torch.strided:
        return None
    ptr = t.untyped_storage().data_ptr()
    if ptr == 0:
        return None
    return (t.device, ptr, t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, t.is_conj(), t.is_neg())


def exact_aliases(tensors: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """``{alias: the first name of the same tensor}`` for every name that is an exact alias of an earlier one."""
    at: dict[int, list[str]] = {}  # aliases start at the same address: only those are compared in full
    for name, t in tensors.items():
        try:
            at.setdefault(t.data_ptr(), []).append(name)
        except RuntimeError:  # no strided memory (sparse, and such): never an alias
            continue
    first: dict[tuple[Any, ...], str] = {}
    out: dict[str, str] = {}
    for names in at.values():
        if len(names) < 2:
            continue
        for name in names:
            key = _view_key(tensors[name])
            if key is None:
                continue
            if key in first:
                out[name] = first[key]
            else:
                first[key] = name
    return out


def item_aliases(indexes: Sequence[MetadataIndex], planner: Any) -> dict[int, int]:
    """``{position: position of its canonical item}`` among one shard's items, from the planner's
    :data:`ALIASES_ATTR` (empty without one): :func:`position_aliases`."""
    declared: Mapping[MetadataIndex, MetadataIndex] | None = getattr(planner, ALIASES_ATTR, None)
    return position_aliases(indexes, declared) if declared else {}


def position_aliases(keys: Sequence[Any], declared: Mapping[Any, Any]) -> dict[int, int]:
    """``{position: position of its canonical key}`` among one shard's ``keys``, given ``declared``
    ``{alias key: canonical key}``. Only a canonical key in the same shard, placed before its alias and
    not itself an alias, counts: any other alias is written as its own copy."""
    where = {k: i for i, k in enumerate(keys)}
    out: dict[int, int] = {}
    for i, k in enumerate(keys):
        j = where.get(declared.get(k))
        if j is not None and j < i and j not in out:
            out[i] = j
    return out


def shared_names(entries: Mapping[str, EntryInfo], names: Sequence[str]) -> dict[str, str]:
    """``{alias: first name}`` among ``names`` whose tensors are stored as exactly the same chunks
    (file, offset, length), dtype and shape: what :func:`exact_aliases` stored once."""
    first: dict[tuple[Any, ...], str] = {}
    out: dict[str, str] = {}
    for n in names:
        e = entries[n]
        if e.kind != "tensor" or not e.chunks or not any(c.length for c in e.chunks):
            continue
        key = (e.dtype_name, e.shape, e.chunks)
        if key in first:
            out[n] = first[key]
        else:
            first[key] = n
    return out
