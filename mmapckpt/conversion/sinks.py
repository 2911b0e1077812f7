"""The write side of conversions: one writer per output format, each streaming item by item.

DCP outputs (mmapckpt and stock) keep the source's file layout, metadata and
non-tensor entries, re-pointing only the storage records. Full-tensor outputs
(safetensors, torch.save) assemble each tensor from its chunks: a chunk that is a
contiguous run of the tensor's bytes (every single-chunk tensor, and row-wise
shards) is written straight from the source; only chunks split along inner
dimensions are gathered in a buffer of one tensor. Memory therefore stays at most
one tensor plus one chunk, whatever the checkpoint's size.
"""

from __future__ import annotations

import json
import os
import pickle
import uuid
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta, TensorStorageMetadata

from ..errors import CheckpointError, FormatError
from ..format import layout as fmt
from ..format.metadata import METADATA_NAME, encode_metadata
from ..io.files import atomic_write, fsync_dir, map_file, pwrite_all
from ..io.progress import Progress
from ..storage.local import LocalStorage
from ..writing.shard import ShardEntry, ShardOptions, write_shard
from .common import SAFETENSORS_DTYPES, SAFETENSORS_INDEX, Source, Writing, label, tensor_chunk_sizes

__all__ = ["write_mmapckpt", "write_dcp", "write_safetensors", "write_torch", "raw_bytes"]

_ST_CODES = {dt: code for code, dt in SAFETENSORS_DTYPES.items()}


def raw_bytes(t: torch.Tensor) -> memoryview:
    """The tensor's bytes in C order; no copy where it is already contiguous on the CPU."""
    flat = t.detach().cpu().resolve_conj().resolve_neg().contiguous().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    if flat.stride(0) != 1:  # one element counts as contiguous whatever its stride
        flat = flat.clone(memory_format=torch.contiguous_format)
    return memoryview(flat.view(torch.uint8).numpy())


def _nbytes(md: TensorStorageMetadata) -> int:
    n = 1
    for s in md.size:
        n *= s
    return n * md.properties.dtype.itemsize


def _fsync_file(fd: int) -> None:
    os.fsync(fd)


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


def write_mmapckpt(src: Source, out_dir: str, *, checkpoint_id: str, progress: Progress,
                   user_metadata: dict[str, str] | None = None) -> list[str]:
    """Write ``src`` as an mmapckpt checkpoint in ``out_dir``, one shard per source file, with the
    shard writer ``MmapWriter`` uses (writing/shard.py).

    Chunks the source stores at one place (tied weights of an mmapckpt checkpoint) are
    written once, under each name (format/aliases.py).
    """
    os.makedirs(out_dir)
    out = LocalStorage(out_dir)
    sizes = tensor_chunk_sizes(src.metadata)
    save_id = str(uuid.uuid4())  # a new checkpoint: its shards and metadata name the same new save
    storage: dict[MetadataIndex, _StorageInfo] = {}
    for rel, items in src.layout:
        entries = _mmapckpt_entries(src, items, sizes)
        done, _ = write_shard(out, rel, entries, src.read_tensor, save_id=save_id, options=_SHARD,
                              aliases=_stored_aliases(src, items, entries), advance=progress.advance,
                              one_at_a_time=True)
        for e, idx in zip(done, items):
            storage[idx] = _StorageInfo(rel, e.offset, e.length)
    md = _out_metadata(src, storage, checkpoint_id, save_id)
    try:
        data = encode_metadata(md, user_metadata)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"the source metadata cannot be stored as mmapckpt metadata: {e}", path=src.path) from e
    atomic_write(os.path.join(out_dir, METADATA_NAME), data)
    return [rel for rel, _ in src.layout]


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


def write_dcp(src: Source, out_dir: str, *, checkpoint_id: str, progress: Progress) -> list[str]:
    """Write ``src`` as a stock DCP checkpoint (what ``FileSystemWriter`` writes) in ``out_dir``."""
    os.makedirs(out_dir)
    storage: dict[MetadataIndex, _StorageInfo] = {}
    for rel, items in src.layout:
        path = os.path.join(out_dir, rel)
        with Writing(path) as w, open(path, "xb") as f:
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
            f.flush()
            _fsync_file(f.fileno())
    atomic_write(os.path.join(out_dir, METADATA_NAME), pickle.dumps(_out_metadata(src, storage, checkpoint_id,
                                                                                   str(uuid.uuid4()))))
    return [rel for rel, _ in src.layout]


# --------------------------------------------------------------------------- full tensors
def _write_full_tensor(fd: int, base: int, fqn: str, md: TensorStorageMetadata, src: Source,
                       progress: Progress) -> None:
    """Write tensor ``fqn`` in C order at ``base`` of ``fd``, assembled from its chunks."""
    shape, item = tuple(md.size), md.properties.dtype.itemsize
    numel = 1
    for s in shape:
        numel *= s
    if numel == 0:  # the chunks tile the tensor: every source's index was checked (format/tiling.py)
        return
    row = item
    for s in shape[1:]:
        row *= s
    if all(tuple(c.sizes)[1:] == shape[1:] for c in md.chunks):  # each chunk is one contiguous run of bytes
        for c in md.chunks:
            buf = raw_bytes(src.read_tensor(MetadataIndex(fqn, c.offsets)))
            pwrite_all(fd, buf, base + (c.offsets[0] * row if shape else 0))
            progress.advance(len(buf))
        return
    full = torch.empty(shape[:-1] + (shape[-1] * item,), dtype=torch.uint8)
    for c in md.chunks:
        chunk = src.read_tensor(MetadataIndex(fqn, c.offsets)).detach().cpu().contiguous().view(torch.uint8)
        region = full
        for d, (o, s) in enumerate(zip(c.offsets, c.sizes)):
            o, s = (o * item, s * item) if d == len(shape) - 1 else (o, s)
            region = region.narrow(d, o, s)
        region.copy_(chunk)
        progress.advance(chunk.numel())
        del chunk
    pwrite_all(fd, memoryview(full.reshape(-1).numpy()), base)


def _split_entries(src: Source) -> tuple[list[tuple[str, TensorStorageMetadata]], list[str]]:
    tensors, others = [], []
    for fqn, item in src.items():
        (tensors.append((fqn, item)) if isinstance(item, TensorStorageMetadata) else others.append(fqn))
    return tensors, others


def _shard_groups(tensors: list[tuple[str, TensorStorageMetadata]], limit: int | None) -> list[list[Any]]:
    """Consecutive tensors packed into files of at most ``limit`` bytes (a larger tensor gets its own file)."""
    if limit is None:
        return [tensors]
    groups: list[list[Any]] = [[]]
    size = 0
    for t in tensors:
        n = _nbytes(t[1])
        if groups[-1] and size + n > limit:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += n
    return groups


def _write_safetensors_file(path: str, tensors: list[tuple[str, TensorStorageMetadata]], src: Source,
                            progress: Progress, user_metadata: dict[str, str] | None = None) -> None:
    # Widest dtypes first keeps every tensor's data aligned to its itemsize, as safetensors itself does.
    tensors = sorted(tensors, key=lambda t: -t[1].properties.dtype.itemsize)
    # "format": "pt" as save_pretrained writes it (transformers refuses other values), then the user's
    header: dict[str, Any] = {"__metadata__": {"format": "pt", **(user_metadata or {})}}
    pos = 0
    for fqn, md in tensors:
        n = _nbytes(md)
        header[fqn] = {"dtype": _ST_CODES[md.properties.dtype], "shape": list(md.size), "data_offsets": [pos, pos + n]}
        pos += n
    hb = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    hb += b" " * (-len(hb) % 8)
    start = 8 + len(hb)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        with Writing(path) as w:
            os.ftruncate(fd, start + pos)
            pwrite_all(fd, len(hb).to_bytes(8, "little") + hb, 0)
            for fqn, md in tensors:
                w.entry = fqn
                _write_full_tensor(fd, start + header[fqn]["data_offsets"][0], fqn, md, src, progress)
            w.entry = None
            _fsync_file(fd)
    finally:
        os.close(fd)


def write_safetensors(src: Source, out: str, *, max_shard_size: int | None, progress: Progress,
                      user_metadata: dict[str, str] | None = None) -> list[str]:
    """Write the tensors of ``src`` as one safetensors file, or as HF-style shards with an index.

    ``user_metadata`` goes into every file's ``__metadata__`` (after ``"format": "pt"``); the
    index's ``metadata`` holds only ``total_size``, as Hugging Face writes it.
    Returns the names of the non-tensor entries, which safetensors cannot hold.
    """
    tensors, dropped = _split_entries(src)
    for fqn, md in tensors:
        if md.properties.dtype not in _ST_CODES:
            raise CheckpointError(f"safetensors cannot store dtype {md.properties.dtype}", path=src.path, entry=fqn)
    if max_shard_size is None:
        _write_safetensors_file(out, tensors, src, progress, user_metadata)
        return dropped
    os.makedirs(out)
    groups = _shard_groups(tensors, max_shard_size)
    weight_map = {}
    for i, group in enumerate(groups, 1):
        name = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        _write_safetensors_file(os.path.join(out, name), group, src, progress, user_metadata)
        weight_map.update({fqn: name for fqn, _ in group})
    index = {"metadata": {"total_size": sum(_nbytes(md) for _, md in tensors)},
             "weight_map": dict(sorted(weight_map.items()))}
    atomic_write(os.path.join(out, SAFETENSORS_INDEX), (json.dumps(index, indent=2) + "\n").encode("utf-8"))
    fsync_dir(out)
    return dropped


# --------------------------------------------------------------------------- torch.save
def write_torch(src: Source, out: str, *, progress: Progress) -> list[str]:
    """Write ``src`` as one ``torch.save`` file of a flat state dict (fqn -> tensor or object).

    Tensors are assembled into a scratch file first and saved from a mapping of it,
    so torch.save never needs the whole state dict in memory. Returns the non-tensor
    entries that could not be unpickled safely (``weights_only=True``) and were left out.
    """
    tensors, _ = _split_entries(src)
    scratch = f"{out}.scratch-{uuid.uuid4().hex[:8]}"
    places, pos = {}, 0
    for fqn, md in tensors:
        places[fqn] = pos
        pos = (pos + _nbytes(md) + 63) // 64 * 64
    dropped: list[str] = []
    try:
        fd = os.open(scratch, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with Writing(scratch) as w:
                os.ftruncate(fd, pos)
                for fqn, md in tensors:
                    w.entry = fqn
                    _write_full_tensor(fd, places[fqn], fqn, md, src, progress)
        finally:
            os.close(fd)
        _save_from_scratch(src, scratch, pos, places, out, dropped)
    finally:
        if os.path.exists(scratch):
            os.unlink(scratch)
    return dropped


def _save_from_scratch(src: Source, scratch: str, size: int, places: dict[str, int], out: str,
                       dropped: list[str]) -> None:
    mapping = map_file(scratch, size)
    state = _scratch_state(src, mapping, places, dropped)
    try:
        with Writing(out) as w, open(out, "xb") as f:
            torch.save(state, w.record(f))
            f.flush()
            _fsync_file(f.fileno())
    finally:  # the scratch file's pages go with the last view of them: also while a failure's traceback lives
        state.clear()
        del state, mapping


def _scratch_state(src: Source, mapping: Any, places: dict[str, int], dropped: list[str]) -> dict[str, Any]:
    """The state dict torch.save writes: tensors are views over the scratch file's mapping."""
    view = memoryview(mapping) if mapping is not None else None
    state: dict[str, Any] = {}
    for fqn, item in src.items():
        if isinstance(item, TensorStorageMetadata):
            n, dtype = _nbytes(item), item.properties.dtype
            if n == 0:
                state[fqn] = torch.empty(tuple(item.size), dtype=dtype)
            else:  # a storage of exactly this tensor's bytes: torch.save writes only them
                raw = torch.frombuffer(view[places[fqn]:places[fqn] + n], dtype=torch.uint8)  # type: ignore[index]
                state[fqn] = raw.view(dtype).reshape(tuple(item.size))
            continue
        try:
            state[fqn] = src.read_object(MetadataIndex(fqn))
        except Exception:  # an object weights_only refuses: we never run arbitrary pickles
            dropped.append(fqn)
    return state
