"""The write side of conversions to DCP checkpoints: mmapckpt and stock, each streaming item by item.

Both keep the source's file layout, metadata and non-tensor entries, re-pointing only the
storage records; memory stays at about one item. (The full-tensor outputs, safetensors and
torch.save, are flat_sinks.py.)

Each writer writes a new version of its destination (storage/replacement.py), whatever the
medium: shard files through ``create_file`` (a ``FileOutput``: it appears under its name only
once complete) under names no file there has, then ``.metadata`` through ``commit``.
"""

from __future__ import annotations

import pickle
import uuid
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta, TensorStorageMetadata

from ..errors import CheckpointError, FormatError
from ..format import layout as fmt
from ..format.metadata import METADATA_NAME, encode_metadata
from .progress import Progress
from ..storage.replacement import Replacement
from ..writing.shard import ShardEntry, ShardOptions, write_shard
from .common import SinkJob, Source, Writing, label, tensor_chunk_sizes
from .outputs import Appending, fresh_name, raw_bytes, write_stored

__all__ = ["write_mmapckpt", "write_dcp", "raw_bytes"]


def _out_metadata(src: Source, storage: dict[MetadataIndex, _StorageInfo], checkpoint_id: str,
                  save_id: str) -> Metadata:
    md = src.metadata
    old = md.storage_meta
    meta = StorageMeta(checkpoint_id=checkpoint_id, save_id=save_id, modules=list(old.modules) if old else [])
    return Metadata(state_dict_metadata=md.state_dict_metadata, planner_data=md.planner_data,
                    storage_data=storage, storage_meta=meta, version=md.version or "1.0.0")


# --------------------------------------------------------------------------- DCP: mmapckpt
#: How the conversion writes each shard (writing/shard.py, the writer MmapWriter uses): page-aligned
#: entries, buffered, fsynced before it is renamed into place.
_SHARD = ShardOptions(alignment=4096, direct=False, sync=True)


def write_mmapckpt(src: Source, out: Replacement, job: SinkJob) -> tuple[list[str], str]:
    """Write ``src`` as an mmapckpt checkpoint into the new version ``out``, one shard per source file, with the
    shard writer ``MmapWriter`` uses (writing/shard.py); nothing is left out, and ``.metadata`` is the commit.

    Chunks the source stores at one place (tied weights of an mmapckpt checkpoint) are
    written once, under each name (format/aliases.py). Shards take names not in ``out.avoid``
    (:func:`fresh_name`), each recorded (``out.add``) once written, and ``.metadata`` is
    committed last.
    """
    sizes = tensor_chunk_sizes(src.metadata)
    save_id = str(uuid.uuid4())  # a new checkpoint: its shards and metadata name the same new save
    storage: dict[MetadataIndex, _StorageInfo] = {}
    for rel, items in src.layout:
        name = fresh_name(rel, save_id, out.avoid)
        entries = _mmapckpt_entries(src, items, sizes)
        done, _ = write_shard(out.storage, name, entries, src.read_tensor, save_id=save_id, options=_SHARD,
                              aliases=_stored_aliases(src, items, entries), advance=job.progress.advance,
                              one_at_a_time=True)
        out.add(name)
        for e, idx in zip(done, items):
            storage[idx] = _StorageInfo(name, e.offset, e.length)
    md = _out_metadata(src, storage, job.checkpoint_id, save_id)
    try:
        data = encode_metadata(md, job.user_metadata)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"the source metadata cannot be stored as mmapckpt metadata: {e}", path=src.path) from e
    out.storage.commit(METADATA_NAME, data, sync=True)
    return [], METADATA_NAME


def _mmapckpt_entries(src: Source, items: list[MetadataIndex],
                      sizes: dict[tuple[str, tuple[int, ...]], tuple[int, ...]]) -> list[ShardEntry]:
    """The shard writer's entries for one source file: non-tensor payloads read now (small; their length is
    needed for the layout), tensor chunks read by the writer (``src.read_tensor``) when their turn comes."""
    entries = []
    for idx in items:
        item = src.metadata.state_dict_metadata.get(idx.fqn)
        if idx.offset is None:
            payload = src.read_bytes(idx)
            entries.append(ShardEntry(idx.fqn, None, fmt.KIND_BYTES, None, (), len(payload), payload))
            continue
        shape = sizes.get((idx.fqn, tuple(idx.offset)))
        if not isinstance(item, TensorStorageMetadata) or shape is None:
            raise FormatError("storage record names a chunk the metadata does not list", path=src.path,
                              entry=label(idx))
        n = 1
        for s in shape:
            n *= s
        entries.append(ShardEntry(idx.fqn, tuple(idx.offset), fmt.KIND_TENSOR, _mmapckpt_dtype(src, idx, item),
                                  shape, n * item.properties.dtype.itemsize, idx))
    return entries


def _mmapckpt_dtype(src: Source, idx: MetadataIndex, item: TensorStorageMetadata) -> str:
    try:
        return fmt.dtype_name(item.properties.dtype)
    except ValueError:
        raise CheckpointError(f"the mmapckpt format cannot store dtype {item.properties.dtype} (docs/format.md, "
                              "section 2.4): leave this entry out (keys=...) or convert to another format",
                              path=src.path, entry=label(idx)) from None


def _stored_aliases(src: Source, items: list[MetadataIndex], specs: list[ShardEntry]) -> dict[int, int]:
    """{position: earlier position} of tensor chunks the source stores at the same (file, offset, length)
    with the same dtype and shape: tied weights, which the output stores once too."""
    if src.metadata.storage_data is None:
        return {}
    first: dict[tuple[Any, ...], int] = {}
    out: dict[int, int] = {}
    for i, (idx, spec) in enumerate(zip(items, specs)):
        info = src.metadata.storage_data.get(idx)
        if idx.offset is None or info is None or not spec.length:
            continue
        key = (info.relative_path, info.offset, info.length, spec.dtype, spec.shape)
        if key in first:
            out[i] = first[key]
        else:
            first[key] = i
    return out


# --------------------------------------------------------------------------- DCP: stock torch.save items
def _own_storage(t: torch.Tensor) -> torch.Tensor:
    """``t`` with a storage of exactly its bytes, so torch.save writes nothing else."""
    t = t.detach().cpu()
    if t.is_contiguous() and t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size():
        return t
    return t.clone(memory_format=torch.contiguous_format)


def _dcp_items(src: Source, rel: str, items: list[MetadataIndex], f: Any, w: Writing,
               storage: dict[MetadataIndex, _StorageInfo], progress: Progress) -> None:
    """The items of one stock DCP file, one after another into ``f`` (torch.save bytes, or a payload)."""
    out = w.record(f)
    for idx in items:
        w.entry = label(idx)
        start = f.tell()
        if idx.offset is None:
            f.write(src.read_bytes(idx))
        else:
            t = _own_storage(src.read_tensor(idx))
            torch.save(t, out)
            progress.advance(t.numel() * t.element_size())
            del t
        storage[idx] = _StorageInfo(rel, start, f.tell() - start)
    w.entry = None


def write_dcp(src: Source, out: Replacement, job: SinkJob) -> tuple[list[str], str]:
    """Write ``src`` as a stock DCP checkpoint (what ``FileSystemWriter`` writes) into the new version ``out``
    (files named, recorded and committed as :func:`write_mmapckpt` does; the user metadata has no place)."""
    save_id = str(uuid.uuid4())
    storage: dict[MetadataIndex, _StorageInfo] = {}
    for rel, items in src.layout:
        name = fresh_name(rel, save_id, out.avoid)
        write_stored(out.storage, name, None, 0,
                     lambda o, w, name=name, items=items: _dcp_items(src, name, items, Appending(o), w, storage,
                                                                     job.progress))
        out.add(name)
    md = _out_metadata(src, storage, job.checkpoint_id, save_id)
    out.storage.commit(METADATA_NAME, pickle.dumps(md), sync=True)
    return [], METADATA_NAME
