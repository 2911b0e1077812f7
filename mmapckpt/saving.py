"""``mmapckpt.save``: a flat ``{name: tensor}`` dict to a checkpoint, in one process, without DCP.

It writes the checkpoint ``dcp.save(sd, storage_writer=MmapWriter(path))`` writes, through the same
steps: the lock and the overwrite rule (storage/commits.py ``begin_save``), the shard files
(writing/files.py, the one shard writer), and the commit of the metadata DCP's default planner makes
for plain tensors (``commit_save``), described in the format's own types
(format/metadata/written.py). So ``dcp.load``, ``mmapckpt.load`` and ``convert`` read it, and a
script that saves imports no ``torch.distributed`` (its import took 0.5-1 s here, most of a small
save in a new process).
"""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from .dcp.storable import check_storable
from .errors import CheckpointWriteError
from .format import layout as fmt
from .format.aliases import exact_aliases, position_aliases
from .format.entries import paused_gc
from .format.metadata import check_user_metadata
from .format.metadata import written as w
from .storage.commits import METADATA_NAME, begin_save, commit_save, existing_shards, shard_name
from .storage.credentials import StorageOptions
from .storage.location import storage_for
from .writing.files import how_written, split_by_size, write_files
from .writing.shard import ShardEntry, ShardOptions

__all__ = ["save", "SavedCheckpoint"]


@dataclass(frozen=True)
class SavedCheckpoint:
    """What :func:`save` saved.

    Attributes:
        path: the checkpoint, as it was given to ``save``.
        save_id: the save's id, recorded in its metadata and in every shard header.
        write_paths: shard file name -> "direct" (written with O_DIRECT) or "buffered".
    """

    path: str
    save_id: str
    write_paths: Mapping[str, str] = field(default_factory=dict)

    @property
    def write_path(self) -> str | None:
        """How the shards were written: "direct", "buffered" or "mixed"."""
        return how_written(self.write_paths)


def save(state_dict: Mapping[str, torch.Tensor], path: str | os.PathLike[str], *, overwrite: bool = True,
         metadata: Mapping[str, str] | None = None, thread_count: int = 1, sync_files: bool = True,
         alignment: int = 4096, direct_io: bool = True,
         storage_options: Mapping[str, Any] | None = None) -> SavedCheckpoint:
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
        thread_count: shard files written in parallel; above 1 the tensors are spread over as many files of
            similar sizes (as ``MmapWriter``'s).
        sync_files: make the shards and the directory durable before the commit (as ``MmapWriter``'s).
        alignment: the offset alignment of entries at least this long (as ``MmapWriter``'s).
        direct_io: write the shards with O_DIRECT where the file system takes it (as ``MmapWriter``'s).
        storage_options: an object store's client settings for a URL ``path`` (docs/object-storage.md).

    Returns:
        What was saved: its ``path``, ``save_id`` and ``write_paths``; ``write_path`` says whether the
        shards were written with O_DIRECT.

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
    where = os.fspath(path)
    _check_plain(tensors, where)  # before anything is written
    user = check_user_metadata(metadata)
    if thread_count < 1:
        raise ValueError(f"thread_count must be >= 1, got {thread_count}")
    options = ShardOptions(alignment, direct_io, sync_files)  # ValueError for an alignment the format refuses
    storage = storage_for(where, error=CheckpointWriteError, options=StorageOptions(storage_options))
    save_id = str(uuid.uuid4())
    lock = begin_save(storage, where, overwrite=overwrite, lock=True)
    try:
        with paused_gc():  # one object per tensor: the collector's passes would dominate a many-tensor save
            write_paths = _save(storage, tensors, where, save_id, options, thread_count, user)
    finally:
        if lock is not None:
            lock.release()
    return SavedCheckpoint(where, save_id, write_paths)


def _save(storage: Any, tensors: dict[str, torch.Tensor], where: str, save_id: str, options: ShardOptions,
          thread_count: int, user: Mapping[str, str] | None) -> dict[str, str]:
    """The shard files, then the commit: the entries, records and metadata DCP's default planner makes."""
    names = list(tensors)
    entries = [ShardEntry(n, (0,) * t.dim(), fmt.KIND_TENSOR, fmt.dtype_name(t.dtype), tuple(t.shape),
                          t.numel() * t.element_size(), t) for n, t in tensors.items()]
    tied = exact_aliases(tensors)
    avoid = frozenset(n for n in existing_shards(storage) if n.startswith("__0_"))
    groups = split_by_size(thread_count, [e.length for e in entries])
    files = [(shard_name("__0_", k, save_id, avoid), [entries[i] for i in g], position_aliases([names[i] for i in g], tied))
             for k, g in enumerate(groups)]
    write_paths: dict[str, str] = {}
    written = write_files(storage, files, lambda t: t, save_id=save_id, options=options, thread_count=thread_count,
                          write_paths=write_paths)
    records = {w.Index(e.fqn, e.chunk_offsets, 0): w.Record(name, d.offset, d.length)
               for (name, group, _), done in zip(files, written) for e, d in zip(group, done)}
    sdm = {e.fqn: w.TensorEntry(w.Properties(e.data.dtype, e.data.requires_grad), e.shape,
                                [w.Chunk(e.chunk_offsets, e.shape)]) for e in entries}
    md = w.WrittenMetadata(w.DCP_VERSION, sdm, {n: (n,) for n in names}, records, w.StorageMeta(where, save_id))
    commit_save(storage, METADATA_NAME, md, user_metadata=user, references=None,
                files={r.relative_path for r in records.values()}, rank_prefix=None, sync=options.sync)
    return write_paths


def _check_plain(tensors: dict[str, Any], path: str) -> None:
    # No DTensor exists unless torch.distributed.tensor was imported: then its class is looked up, never imported.
    dtensor_module = sys.modules.get("torch.distributed.tensor")
    DTensor = getattr(dtensor_module, "DTensor", ())  # noqa: N806
    for fqn, t in tensors.items():
        if not isinstance(fqn, str) or not isinstance(t, torch.Tensor) or isinstance(t, DTensor):
            raise TypeError(f"mmapckpt.save takes {{str: plain tensor}}; {fqn!r} is a {type(t).__name__} "
                            "(use dcp.save with MmapWriter for DTensors and other objects)")
        check_storable(fqn, t, path)
