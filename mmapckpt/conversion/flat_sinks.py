"""The write side of conversions to full-tensor formats: safetensors (a file, or Hugging Face shards with an index)
and ``torch.save``.

Each tensor is assembled from its chunks: a chunk that is a contiguous run of the tensor's
bytes (every single-chunk tensor, and row-wise shards) is written straight from the source;
only chunks split along inner dimensions are gathered in a buffer of one tensor. Memory
therefore stays at most one tensor plus one chunk, whatever the checkpoint's size. Every
file goes into a new version of the destination (storage/replacement.py) through a
``FileOutput``: a safetensors file as the tensors' bytes in order, then the header, known
before them, as its head; a ``torch.save`` archive as the stream torch writes.
"""

from __future__ import annotations

import json
import os
import uuid
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

from ..errors import CheckpointError
from ..io.files import map_file, pwrite_all
from .progress import Progress
from ..storage.base import CheckpointStorage, FileOutput
from ..storage.replacement import Replacement
from .common import SAFETENSORS_DTYPES, SAFETENSORS_INDEX, SinkJob, Source, Writing
from .outputs import Appending, Put, copy_side_files, fresh_name, nbytes, raw_bytes, write_stored

__all__ = ["write_safetensors", "write_safetensors_file", "write_torch", "safetensors_shards"]

_ST_CODES = {dt: code for code, dt in SAFETENSORS_DTYPES.items()}


def _write_full_tensor(put: Put, base: int, fqn: str, md: TensorStorageMetadata, src: Source,
                       progress: Progress) -> None:
    """Write tensor ``fqn`` in C order at ``base`` through ``put``, assembled from its chunks, at ascending
    offsets."""
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
        for c in sorted(md.chunks, key=lambda c: tuple(c.offsets)):
            buf = raw_bytes(src.read_tensor(MetadataIndex(fqn, c.offsets)))
            put(base + (c.offsets[0] * row if shape else 0), buf)
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
    put(base, memoryview(full.reshape(-1).numpy()))


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
        n = nbytes(t[1])
        if groups[-1] and size + n > limit:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += n
    return groups


def safetensors_shards(src: Source, limit: int) -> list[tuple[str, list[tuple[str, TensorStorageMetadata]]]]:
    """The Hugging Face shards of the tensors of ``src``, at most ``limit`` bytes each: ``[(file name, tensors)]``
    (refused where a dtype has no safetensors code)."""
    tensors, _ = _split_entries(src)
    _check_safetensors_dtypes(src, tensors)
    groups = _shard_groups(tensors, limit)
    return [(f"model-{i:05d}-of-{len(groups):05d}.safetensors", group) for i, group in enumerate(groups, 1)]


def _check_safetensors_dtypes(src: Source, tensors: list[tuple[str, TensorStorageMetadata]]) -> None:
    for fqn, md in tensors:
        if md.properties.dtype not in _ST_CODES:
            raise CheckpointError(f"safetensors cannot store dtype {md.properties.dtype}", path=src.path, entry=fqn)


def _safetensors_layout(tensors: list[tuple[str, TensorStorageMetadata]],
                        user_metadata: dict[str, str] | None) -> tuple[list[tuple[str, Any, int]], bytes, int]:
    """``([(fqn, md, data offset)], head (length + header), file size)`` of a safetensors file of ``tensors``."""
    # Widest dtypes first keeps every tensor's data aligned to its itemsize, as safetensors itself does.
    tensors = sorted(tensors, key=lambda t: -t[1].properties.dtype.itemsize)
    # "format": "pt" as save_pretrained writes it (transformers refuses other values), then the user's
    header: dict[str, Any] = {"__metadata__": {"format": "pt", **(user_metadata or {})}}
    pos = 0
    for fqn, md in tensors:
        n = nbytes(md)
        header[fqn] = {"dtype": _ST_CODES[md.properties.dtype], "shape": list(md.size), "data_offsets": [pos, pos + n]}
        pos += n
    hb = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    hb += b" " * (-len(hb) % 8)
    start = 8 + len(hb)
    placed = [(fqn, md, start + header[fqn]["data_offsets"][0]) for fqn, md in tensors]
    return placed, len(hb).to_bytes(8, "little") + hb, start + pos


def write_safetensors_file(storage: CheckpointStorage, name: str, tensors: list[tuple[str, TensorStorageMetadata]],
                           src: Source, progress: Progress, user_metadata: dict[str, str] | None = None) -> None:
    """The safetensors file of ``tensors`` as file ``name`` of ``storage`` (a ``FileOutput``: the tensors' bytes
    in order, the header, known first, written as its head last), byte for byte the local file."""
    placed, head, size = _safetensors_layout(tensors, user_metadata)

    def body(out: FileOutput, w: Writing) -> bytes:
        for fqn, md, at in placed:
            w.entry = fqn
            _write_full_tensor(out.put, at, fqn, md, src, progress)
        w.entry = None
        return head

    write_stored(storage, name, size, len(head), body)


def write_safetensors(src: Source, out: Replacement, job: SinkJob) -> tuple[list[str], str]:
    """Write the tensors of ``src`` into the new version ``out``: as one safetensors file ``job.name``, or (with
    ``job.max_shard_size``) as HF-style shards with an index. Returns the names of the non-tensor entries, which
    safetensors cannot hold, and the commit's name (the file, or the index).

    Into a directory, a Hugging Face source's side files (config, tokenizer) come first (the weights' file
    or index, written last, is the commit). A shard whose name a file there has (``out.avoid``) is named
    with a tag in it (outputs.py ``fresh_name``: the index names it, so no file an old index names is
    overwritten before the new index replaces it); every file is recorded (``out.add``) once written,
    and the index is committed last. ``job.user_metadata`` goes into every file's ``__metadata__`` (after
    ``"format": "pt"``); the index's ``metadata`` holds only ``total_size``, as Hugging Face writes it.
    """
    if job.as_dir and src.side_files and os.path.isdir(src.path):  # Hugging Face -> Hugging Face
        copy_side_files(src.path, out)
    progress, user_metadata, name = job.progress, job.user_metadata, job.name
    tensors, dropped = _split_entries(src)
    _check_safetensors_dtypes(src, tensors)
    if job.max_shard_size is None:
        write_safetensors_file(out.storage, name, tensors, src, progress, user_metadata)
        out.add(name)
        return dropped, name
    tag = str(uuid.uuid4())
    weight_map = {}
    for shard, group in safetensors_shards(src, job.max_shard_size):
        shard = fresh_name(shard, tag, out.avoid)
        write_safetensors_file(out.storage, shard, group, src, progress, user_metadata)
        out.add(shard)
        weight_map.update({fqn: shard for fqn, _ in group})
    index = {"metadata": {"total_size": sum(nbytes(md) for _, md in tensors)},
             "weight_map": dict(sorted(weight_map.items()))}
    out.storage.commit(SAFETENSORS_INDEX, (json.dumps(index, indent=2) + "\n").encode("utf-8"), sync=True)
    return dropped, SAFETENSORS_INDEX


# --------------------------------------------------------------------------- torch.save
def write_torch(src: Source, out: Replacement, job: SinkJob) -> tuple[list[str], str]:
    """Write ``src`` as one ``torch.save`` file ``job.name`` of the new version ``out``: a flat state dict
    (fqn -> tensor or object), which is the commit.

    Tensors are assembled into a local scratch file first (``out.scratch()``; progress phase
    ``"assemble"``) and saved from a mapping of it (phase ``"torch.save"``) through a
    ``FileOutput``, so torch.save never needs the whole state dict in memory. The scratch file is
    unlinked once mapped: a process killed at any moment leaves at most one file behind, and the
    mapping frees its blocks when the process ends. Returns the non-tensor entries that could not
    be unpickled safely (``weights_only=True``) and were left out.
    """
    name, progress = job.name, job.progress
    tensors, _ = _split_entries(src)
    scratch = out.scratch()
    places, pos = {}, 0
    for fqn, md in tensors:
        places[fqn] = pos
        pos = (pos + nbytes(md) + 63) // 64 * 64
    total = sum(nbytes(md) for _, md in tensors)
    dropped: list[str] = []
    progress.phase("assemble", total)
    try:
        fd = os.open(scratch, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with Writing(scratch) as w:
                os.ftruncate(fd, pos)
                for fqn, md in tensors:
                    w.entry = fqn
                    _write_full_tensor(lambda o, b: pwrite_all(fd, b, o), places[fqn], fqn, md, src, progress)
        finally:
            os.close(fd)
        mapping = map_file(scratch, pos)
        os.unlink(scratch)  # the mapping keeps the bytes; a kill from here on leaves only the output's temp file
        progress.phase("torch.save", total)
        try:
            _save_from_scratch(src, mapping, places, out, name, dropped, progress)
        finally:  # the unlinked file's blocks go with the mapping: not kept by a failure's traceback
            del mapping
    finally:
        if os.path.exists(scratch):
            os.unlink(scratch)
    out.add(name)
    return dropped, name


class _Counted:
    """The file torch.save writes, counting its bytes into the progress (at most the phase's bytes)."""

    def __init__(self, f: Any, progress: Progress) -> None:
        self.f, self.progress = f, progress

    def write(self, b: Any) -> int:
        n = self.f.write(b)
        self.progress.advance(memoryview(b).nbytes)
        return n

    def flush(self) -> None:
        self.f.flush()

    def tell(self) -> int:
        return self.f.tell()


def _save_from_scratch(src: Source, mapping: Any, places: dict[str, int], out: Replacement, name: str,
                       dropped: list[str], progress: Progress) -> None:
    state = _scratch_state(src, mapping, places, dropped)

    def body(o: FileOutput, w: Writing) -> None:
        torch.save(state, w.record(_Counted(Appending(o), progress)))  # Ctrl-C in the count is recorded too

    try:
        write_stored(out.storage, name, None, 0, body)
    finally:  # the scratch file's pages go with the last view of them: also while a failure's traceback lives
        state.clear()
        state = mapping = None  # noqa: F841 - the last references, dropped here (the closure's included)


def _scratch_state(src: Source, mapping: Any, places: dict[str, int], dropped: list[str]) -> dict[str, Any]:
    """The state dict torch.save writes: tensors are views over the scratch file's mapping."""
    view = memoryview(mapping) if mapping is not None else None
    state: dict[str, Any] = {}
    for fqn, item in src.items():
        if isinstance(item, TensorStorageMetadata):
            n, dtype = nbytes(item), item.properties.dtype
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
