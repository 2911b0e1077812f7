"""DCP planners with a fast path for the common items: the recommended pair with MmapWriter/MmapReader.

``FastLoadPlanner`` and ``FastSavePlanner`` are DCP's ``DefaultLoadPlanner`` and
``DefaultSavePlanner`` (subclasses: flattening, resharding, ``allow_partial_load``,
non-tensor values, ShardedTensors all work as there) that plan the items DCP spends
its time on without its general machinery, producing the very same plans:

- load: a plain tensor (or ``nn.Parameter``) stored as one whole chunk gets its one
  ``ReadItem`` directly (the default runs a sweep over the stored and local chunks and
  builds the item from lists), read from the entry index itself when the metadata is
  MmapReader's (records.py: DCP's records are then never built for it); a DTensor
  whose one local shard is exactly one stored
  chunk (saved and loaded with the same sharding) likewise; everything else (resharding,
  several chunks, size mismatches and their errors) goes through DCP's own code.
  ``lookup_tensor``/``transform_tensor`` return plain targets without the Protocol and
  narrowing steps (``resolve_tensor``/``commit_tensor`` are DCP's, so MmapReader still
  reads straight into the targets).
- save: a plain tensor's ``WriteItem`` is built directly; the global plan skips the
  dedup of a single rank's plan (it keeps every item), rewrites the index hints without
  ``dataclasses.replace`` and validates only the entries that are not one whole chunk
  (a whole chunk cannot fail the validation).

The planning runs with the cyclic garbage collector paused (``format.entries.paused_gc``):
a plan of 20,000 items allocates a few hundred thousand small objects, and the collections
they trigger walk all of them again and again. ``tests/dcp/test_fast_planner.py`` checks
that the plans, the metadata and the loaded bytes equal the default planners'.
"""

from __future__ import annotations

import dataclasses
from collections import ChainMap
from typing import Any

import torch
from torch.distributed.checkpoint import _version
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
    _validate_global_plan,
)
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    ReadItem,
    SavePlan,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import _create_read_items, _create_write_items
from torch.distributed.tensor import DTensor

from ..format.entries import paused_gc
from .flatten import flatten_plain, fresh_lists
from .plan_items import metadata_index, read_item, tensor_write_item, whole_read_item, write_item
from .records import StateDictRecords
from .storable import check_storable

__all__ = ["FastLoadPlanner", "FastSavePlanner"]

_PLAIN = (torch.Tensor, torch.nn.Parameter)  # exact types: subclasses (DTensor...) take DCP's path


def _dtensor_item(fqn: str, obj: DTensor, md: TensorStorageMetadata) -> ReadItem | None:
    """The one item for a DTensor whose one local chunk is exactly one stored chunk, overlapping no other; else None."""
    local = obj.__create_chunk_list__()
    if len(local) != 1:
        return None
    off, sz = local[0].offsets, local[0].sizes
    if not sz or 0 in sz:
        return None
    ends = [o + s for o, s in zip(off, sz)]
    hit = -1
    for i, c in enumerate(md.chunks):
        co, cs = c.offsets, c.sizes
        if all(a < e and b < a + s for a, s, b, e in zip(co, cs, off, ends)):  # overlaps the local chunk
            if hit >= 0 or co != off or cs != sz:
                return None  # resharding: DCP's sweep
            hit = i
    return None if hit < 0 else read_item(fqn, off, md.chunks[hit].offsets, hit, sz)


def _load_items(state_dict: dict[str, Any], metadata: Metadata, strict: bool) -> list[ReadItem]:
    """``create_default_local_load_plan``'s items, with the common cases built directly."""
    sdm = metadata.state_dict_metadata
    entries = sdm.entries if type(sdm) is StateDictRecords else None  # MmapReader's: the index, no DCP records
    items: list[ReadItem] = []
    for fqn, obj in state_dict.items():
        cls = type(obj)
        if entries is not None and cls in _PLAIN:
            e = entries.get(fqn)
            if e is not None and e.kind == "tensor" and len(e.chunks) == 1:
                size = obj.size()
                c = e.chunks[0]
                if e.shape == size and c.sizes == size and not any(c.offsets):
                    if 0 not in size:  # a zero-size dim overlaps nothing: DCP plans no read
                        items.append(whole_read_item(fqn, size))
                    continue
        md = sdm.get(fqn)
        if md is None and fqn not in sdm:
            if strict:
                raise RuntimeError(f"Missing key in checkpoint state_dict: {fqn}.")
            continue
        if type(md) is TensorStorageMetadata:
            if cls in _PLAIN:
                size = obj.size()
                chunks = md.chunks
                if md.size == size and len(chunks) == 1 and chunks[0].sizes == size and not any(chunks[0].offsets):
                    if 0 not in size:  # a zero-size dim overlaps nothing: DCP plans no read
                        items.append(whole_read_item(fqn, size))
                    continue
            elif cls is DTensor and md.size == obj.size():
                if obj.device_mesh.get_coordinate() is None:
                    continue
                item = _dtensor_item(fqn, obj, md)
                if item is not None:
                    items.append(item)
                    continue
        items += _default_items(fqn, obj, md)
    return items


def _default_items(fqn: str, obj: Any, md: Any) -> list[ReadItem]:
    """The body of ``create_default_local_load_plan``'s loop, for one entry."""
    if isinstance(md, TensorStorageMetadata) and getattr(obj, "size", None) is not None and md.size != obj.size():
        raise ValueError(f"Size mismatch between saved {md.size} and current: {obj.size()} for {fqn}")
    if isinstance(obj, DTensor) and obj.device_mesh.get_coordinate() is None:
        return []
    return _create_read_items(fqn, md, obj)


def _flat_plain(state_dict: Any) -> bool:
    """Whether ``state_dict`` is a flat ``{str: plain tensor}`` dict, none on the meta device.

    DCP's flattening and meta-tensor initialisation then change nothing: the flattened dict
    has the same items, each mapped to the path ``(key,)``.
    """
    if type(state_dict) is not dict:
        return False
    for k, v in state_dict.items():
        if type(k) is not str or type(v) not in _PLAIN or v.is_meta:
            return False
    return True


def _set_up_flat(planner: Any, state_dict: dict[str, Any]) -> dict[str, Any]:
    """What DCP's flattening steps make of a flat plain dict: a copy (or the dict itself if neither runs)."""
    if planner.flatten_state_dict:
        planner.mappings = {k: (k,) for k in state_dict}
    return dict(state_dict) if planner.flatten_state_dict or planner.flatten_sharded_tensors else state_dict


def _flatten_nested(planner: Any, state_dict: Any, *, load: bool) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """What the default planner's set_up_planner makes of a nested state dict of plain parts
    (flatten.py): the flat dict and the mappings, or None for DCP's own steps.

    A load first replaces the lists in ``state_dict`` by copies, as ``_init_state_dict`` does.
    """
    if not planner.flatten_state_dict or type(state_dict) is not dict:
        return None
    return flatten_plain(fresh_lists(state_dict) if load else state_dict)


def _plain_target(state_dict: dict[str, Any], index: MetadataIndex) -> torch.Tensor | None:
    """The plain tensor ``find_state_dict_object`` would return for ``index``, or None to ask it."""
    obj = state_dict.get(index.fqn)
    if type(obj) in _PLAIN:
        off = index.offset
        if off is None or (len(off) == obj.dim() and not any(off)):
            return obj
    return None


class FastLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` with a fast path for whole-chunk tensors and same-sharding DTensors.

    The recommended load planner with :class:`~mmapckpt.MmapReader`: same arguments,
    same plans (each ``ReadItem`` equal to the default planner's, index hints included),
    several times less planning per tensor. ``dcp.load`` itself checks every top-level
    key against ``Stateful`` twice: load many tensors under one key, as they were saved.

    Example:
        >>> dcp.load({"model": sd}, storage_reader=MmapReader(path), planner=FastLoadPlanner())
    """

    def set_up_planner(self, state_dict: Any, metadata: Metadata | None = None, is_coordinator: bool = False) -> None:
        if _flat_plain(state_dict):
            self.state_dict = _set_up_flat(self, state_dict)
        else:
            with paused_gc():
                flat = _flatten_nested(self, state_dict, load=True)
                if flat is None:
                    super().set_up_planner(state_dict, metadata, is_coordinator)
                    return
            self.state_dict, self.mappings = flat
        self.original_state_dict = state_dict
        self.metadata, self.is_coordinator = metadata, is_coordinator

    def create_local_plan(self) -> LoadPlan:
        if self.metadata is None:
            raise AssertionError("self.metadata is not None")
        with paused_gc():
            if self.flatten_state_dict:
                self._keys_of_old_checkpoints()
            return LoadPlan(_load_items(self.state_dict, self.metadata, not self.allow_partial_load))

    def _keys_of_old_checkpoints(self) -> None:
        """DefaultLoadPlanner's handling of checkpoints saved before torch 2.4 (flattened differently)."""
        missing = self.metadata.state_dict_metadata.keys() - self.state_dict.keys()  # type: ignore[union-attr]
        if missing:
            _version._derived_version = "2_3"
            try:
                old_state_dict, old_mappings = flatten_state_dict(self.original_state_dict)
            finally:
                _version._derived_version = None
            if old_state_dict.keys() & missing:
                self.state_dict, self.mappings = old_state_dict, old_mappings

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        t = _plain_target(self.state_dict, index)
        return t if t is not None else super().lookup_tensor(index)

    def transform_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> Any:
        if not any(read_item.dest_offsets) and read_item.lengths == tensor.size():
            return tensor  # what narrow_tensor_by_index returns: nothing to narrow
        return super().transform_tensor(read_item, tensor)

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        # lookup_tensor and transform_tensor above in one call, unless a subclass overrides either
        cls = type(self)
        if cls.lookup_tensor is _LOOKUP and cls.transform_tensor is _TRANSFORM:
            t = _plain_target(self.state_dict, read_item.dest_index)
            if t is not None and not any(read_item.dest_offsets) and read_item.lengths == t.size():
                return t
        return super().resolve_tensor(read_item)


_LOOKUP, _TRANSFORM = FastLoadPlanner.lookup_tensor, FastLoadPlanner.transform_tensor


def _save_items(state_dict: dict[str, Any]) -> list[WriteItem]:
    """``create_default_local_save_plan``'s items, plain tensors built directly."""
    items: list[WriteItem] = []
    props: dict[tuple[Any, ...], TensorProperties] = {}  # equal values, one object per kind of tensor
    for fqn, obj in state_dict.items():
        if type(obj) in _PLAIN:
            check_storable(fqn, obj, None)  # a meta, sparse, nested... tensor: named, before any file is written
            items.append(tensor_write_item(fqn, obj, props))
        elif isinstance(obj, DTensor):
            if obj.device_mesh.get_coordinate() is not None:
                items += _create_write_items(fqn, obj)
        else:
            if isinstance(obj, torch.Tensor):  # a subclass (DCP's own path), still refused by name if unstorable
                check_storable(fqn, obj, None)
            items += _create_write_items(fqn, obj)
    return items


def _global_save_plan(all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
    """``create_default_global_save_plan`` (index hints rewritten), without ``dataclasses.replace`` per item."""
    md: dict[str, Any] = {}
    new_plans = []
    for plan in all_plans:
        new_items = []
        for item in plan.items:
            fqn = item.index.fqn
            if item.type != WriteItemType.SHARD and fqn in md:
                raise AssertionError("item.index.fqn not in md")
            if item.type == WriteItemType.BYTE_IO:
                md[fqn] = BytesStorageMetadata()
                new_items.append(item)
                continue
            td = item.tensor_data
            if td is None:
                raise AssertionError("item.tensor_data is not None")
            tmd = md.get(fqn)
            if tmd is None:
                tmd = md[fqn] = TensorStorageMetadata(properties=td.properties, size=td.size, chunks=[])
            new_items.append(write_item(metadata_index(fqn, item.index.offset, len(tmd.chunks)), item.type,
                                        item.bytes_io_data, td))
            if td.chunk is None:
                raise AssertionError(f"Cannot create MD for tensor without bounds. FQN: {fqn}")
            tmd.chunks.append(td.chunk)
        new_plans.append(dataclasses.replace(plan, items=new_items))
    return new_plans, Metadata(md)


def _validation_errors(global_plan: list[SavePlan], metadata: Metadata) -> list[str]:
    """``_validate_global_plan``'s errors; entries stored as one whole chunk cannot have any, so are skipped."""
    rest = {}
    for k, v in metadata.state_dict_metadata.items():
        if type(v) is TensorStorageMetadata:
            ch = v.chunks
            if len(ch) == 1 and ch[0].sizes == v.size and not any(ch[0].offsets):
                continue
        rest[k] = v
    return _validate_global_plan(global_plan, Metadata(rest)) if rest else []


class FastSavePlanner(DefaultSavePlanner):
    """``DefaultSavePlanner`` with a fast path for plain tensors and for the global plan.

    The recommended save planner with :class:`~mmapckpt.MmapWriter`: same arguments,
    same plans and metadata as the default planner (index hints and ``planner_data``
    included). With ``enable_plan_caching=True`` it plans as the default planner does.
    ``dcp.save`` itself wraps every top-level key in a logging decorator: pass a model's
    many tensors under one key (``{"model": sd}``), not as a flat dict (docs/benchmarks.md).

    Example:
        >>> dcp.save({"model": sd}, storage_writer=MmapWriter(path), planner=FastSavePlanner())
    """

    def set_up_planner(self, state_dict: Any, storage_meta: Any = None, is_coordinator: bool = False) -> None:
        if _flat_plain(state_dict):
            self.state_dict = _set_up_flat(self, state_dict)
        else:
            with paused_gc():
                flat = _flatten_nested(self, state_dict, load=False)
                if flat is None:
                    super().set_up_planner(state_dict, storage_meta, is_coordinator)
                    return
            self.state_dict, self.mappings = flat
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> SavePlan:
        if self._enable_plan_caching:
            return super().create_local_plan()
        with paused_gc():
            plan = SavePlan(_save_items(self.state_dict))
        if self.flatten_state_dict:
            plan = dataclasses.replace(plan, planner_data=self.mappings)
        self.plan = plan
        return plan

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        if self._enable_plan_caching:
            return super().create_global_plan(all_plans)
        with paused_gc():
            # one rank's plan keeps every item in dedup_save_plans; an overridden dedup still runs
            own_dedup = type(self)._dedup_save_plans is DefaultSavePlanner._dedup_save_plans
            deduped = all_plans if len(all_plans) == 1 and own_dedup else self._dedup_save_plans(all_plans)
            global_plan, metadata = _global_save_plan(deduped)
            if self.flatten_state_dict:
                merged = dict(ChainMap(*[p.planner_data for p in global_plan]))
                metadata = dataclasses.replace(metadata, planner_data=merged)
            errors = _validation_errors(global_plan, metadata)
        if errors:
            summary = "; ".join(errors)
            raise ValueError(f"Failed to validate global plan: {summary[:500] + '... (truncated)' if len(summary) > 500 else summary}")
        self.global_plan, self.metadata = global_plan, metadata
        return global_plan, metadata

    def lookup_object(self, index: MetadataIndex) -> Any:
        t = _plain_target(self.state_dict, index)
        return t if t is not None else super().lookup_object(index)
