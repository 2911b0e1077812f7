"""``mmapckpt.save``: a flat ``{name: tensor}`` dict to a checkpoint, in one process, without DCP planning.

It drives :class:`MmapWriter` through the same ``StorageWriter`` steps ``dcp.save``
takes (plan, write, commit), with the items and metadata DCP's default planner makes
for plain tensors, so the checkpoint is the one ``dcp.save(sd, storage_writer=
MmapWriter(path))`` writes: ``dcp.load``, ``mmapckpt.load`` and ``convert`` read it.
DCP's planning costs tens of microseconds a tensor; this costs a few.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorProperties, TensorStorageMetadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem

from .dcp.plan_items import tensor_write_item
from .dcp.storable import check_storable
from .dcp.writer import MmapWriter
from .format.aliases import exact_aliases
from .format.entries import paused_gc

__all__ = ["save"]


class _Tensors(SavePlanner):
    """The writer asks the planner for each item's data: here, the tensor itself."""

    mmapckpt_storable_checked = True  # dcp/storable.py CHECKED_ATTR: _check_plain checked every tensor

    def __init__(self, tensors: Mapping[str, torch.Tensor], aliases: dict[MetadataIndex, MetadataIndex]) -> None:
        self.tensors = tensors
        self.mmapckpt_aliases = aliases  # format/aliases.py ALIASES_ATTR: tied weights, stored once

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor:
        return self.tensors[write_item.index.fqn]  # stage_to_host detaches what needs it

    # The planning steps belong to dcp.save, which this path does not take.
    def set_up_planner(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError

    create_local_plan = create_global_plan = finish_plan = set_up_planner  # type: ignore[assignment]


def save(state_dict: Mapping[str, torch.Tensor], path: str | os.PathLike[str], *, overwrite: bool = True,
         metadata: Mapping[str, str] | None = None, **writer_options: Any) -> MmapWriter:
    """Save a flat ``{name: tensor}`` dict as a one-shard mmapckpt checkpoint (durable, atomic).

    Tied weights (names that are exactly one tensor: same storage, offset, shape, strides and
    dtype, as ``lm_head.weight is embed.weight``) are stored once, under both names, and
    ``mmapckpt.load`` gives them back as one tensor. Views that only overlap (a transpose, a
    slice) are each stored as their own values, and come back as separate tensors.

    Args:
        state_dict: names to tensors (any device; DTensors need ``dcp.save``).
        path: the checkpoint directory (created if missing).
        overwrite: allow replacing a checkpoint in ``path`` (as ``MmapWriter``).
        metadata: user metadata ``{str: str}``, as safetensors' ``save_file(metadata=)``; stored
            in ``.metadata`` and kept by ``convert`` to mmapckpt and safetensors.
        writer_options: further ``MmapWriter`` options (``sync_files``, ``alignment``, ``direct_io``).

    Returns:
        The writer, whose ``write_path`` says whether the shard was written with O_DIRECT.

    Raises:
        TypeError: a value is not a tensor, or is a DTensor; ``metadata`` is not ``{str: str}``.
        CheckpointWriteError: a tensor that cannot be stored (meta, sparse, nested, quantized, a
            wrapper subclass: it names the entry, and nothing is written), or as ``MmapWriter``.
        CheckpointExistsError: as ``MmapWriter``.

    Example:
        >>> mmapckpt.save(model.state_dict(), "/tmp/ckpt")
        >>> model.load_state_dict(mmapckpt.load("/tmp/ckpt"))
    """
    tensors = dict(state_dict)
    _check_plain(tensors, os.fspath(path))  # before anything is written
    writer = MmapWriter(path, overwrite=overwrite, metadata=metadata, **writer_options)
    with paused_gc():
        _steps(writer, tensors)  # returns having dropped every object it built: the collector never walks them
    return writer


def _steps(writer: MmapWriter, tensors: dict[str, torch.Tensor]) -> None:
    """The StorageWriter steps of ``dcp.save``, with the items and metadata DCP's default planner makes."""
    items, sdm = _items(tensors)
    tied = exact_aliases(tensors)
    aliases = {MetadataIndex(a, sdm[a].chunks[0].offsets): MetadataIndex(c, sdm[c].chunks[0].offsets)
               for a, c in tied.items()}
    writer.set_up_storage_writer(True, rank=0, use_collectives=True)
    try:
        plan = writer.prepare_global_plan([writer.prepare_local_plan(SavePlan(items))])[0]
        results = writer.write_data(plan, _Tensors(tensors, aliases)).wait()
        metadata = Metadata(state_dict_metadata=sdm, planner_data={fqn: (fqn,) for fqn in tensors})
        writer.finish(metadata, [results])
    finally:
        writer.release()  # the save lock, also when a step failed (finish releases it otherwise)


def _items(tensors: dict[str, torch.Tensor]) -> tuple[list[WriteItem], dict[str, TensorStorageMetadata]]:
    """One whole-tensor WriteItem and state-dict entry per tensor, as DCP's default planner makes them
    (built directly: dcp/plan_items.py; their properties and zero offsets shared between tensors of one
    kind: DCP's values, built once)."""
    items, sdm = [], {}
    props: dict[tuple[Any, ...], TensorProperties] = {}
    for fqn, t in tensors.items():
        item = tensor_write_item(fqn, t, props, 0)
        td = item.tensor_data
        items.append(item)
        sdm[fqn] = TensorStorageMetadata(td.properties, td.size, [td.chunk])  # type: ignore[union-attr]
    return items, sdm


def _check_plain(tensors: dict[str, Any], path: str) -> None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        DTensor = ()  # noqa: N806
    for fqn, t in tensors.items():
        if not isinstance(fqn, str) or not isinstance(t, torch.Tensor) or isinstance(t, DTensor):
            raise TypeError(f"mmapckpt.save takes {{str: plain tensor}}; {fqn!r} is a {type(t).__name__} "
                            "(use dcp.save with MmapWriter for DTensors and other objects)")
        check_storable(fqn, t, path)
