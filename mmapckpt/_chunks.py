"""Where a checkpoint's tensors are and how to get their chunks.

``index_entries`` joins the metadata's entries with their storage records;
``ChunkFiles`` opens the shard files (mmapckpt shards validated and mapped, stock
files read per item with ``torch.load(weights_only=True)``) and returns each
chunk as a CPU tensor, a view over the mapping where it can.
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass
from typing import Iterable

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

from . import format as fmt
from ._io import open_inside
from ._shard import Shard, check_size_unchanged, is_mmapckpt_shard
from ._stock import load_tensor, read_item
from .errors import FormatError, IncompleteCheckpointError, SizeMismatchError

__all__ = ["ChunkInfo", "EntryInfo", "ChunkFiles", "index_entries", "check_coverage", "numel"]


@dataclass(frozen=True)
class ChunkInfo:
    """One stored chunk of a tensor: its place in the global tensor and in its file."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str  # relative to the checkpoint directory
    file_offset: int
    length: int


@dataclass(frozen=True)
class EntryInfo:
    """What a checkpoint holds under one name.

    ``kind`` is ``"tensor"`` or ``"object"`` (a pickled non-tensor value); ``dtype``
    and ``shape`` are None for objects. ``chunks`` lists where the bytes are.
    """

    name: str
    kind: str
    dtype: torch.dtype | None
    shape: tuple[int, ...] | None
    chunks: tuple[ChunkInfo, ...]

    @property
    def nbytes(self) -> int:
        return sum(c.length for c in self.chunks) if self.kind == "object" else (
            numel(self.shape or ()) * torch._utils._element_size(self.dtype))  # type: ignore[arg-type]


def numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def index_entries(md: Metadata, path: str) -> dict[str, EntryInfo]:
    """Index the metadata by name, joining each chunk with its storage record."""
    records = {(idx.fqn, None if idx.offset is None else tuple(idx.offset)): info
               for idx, info in (md.storage_data or {}).items()}
    out: dict[str, EntryInfo] = {}
    for name, item in md.state_dict_metadata.items():
        if isinstance(item, BytesStorageMetadata):
            keys = [(name, None)]
        elif isinstance(item, TensorStorageMetadata):
            keys = [(name, tuple(c.offsets)) for c in item.chunks]
        else:
            raise FormatError(f"unknown metadata item type {type(item).__name__}", path=path, entry=name)
        chunks = []
        for key, c in zip(keys, getattr(item, "chunks", [None])):
            info = records.get(key)
            if info is None:
                label = name if key[1] is None else f"{name}@{list(key[1])}"
                raise FormatError("metadata has no storage record for this entry", path=path, entry=label)
            sizes = () if c is None else tuple(c.sizes)
            chunks.append(ChunkInfo(key[1] or (), sizes, info.relative_path, info.offset, info.length))
        if isinstance(item, BytesStorageMetadata):
            out[name] = EntryInfo(name, "object", None, None, tuple(chunks))
        else:
            out[name] = EntryInfo(name, "tensor", item.properties.dtype, tuple(item.size), tuple(chunks))
    return out


def check_coverage(info: EntryInfo, path: str) -> None:
    """The chunks must tile the tensor: inside it, disjoint, volumes adding up to it."""
    shape = info.shape or ()
    total = 0
    for c in info.chunks:
        if len(c.offsets) != len(shape) or any(o + s > g for o, s, g in zip(c.offsets, c.sizes, shape)):
            raise FormatError(f"chunk {list(c.offsets)}+{list(c.sizes)} lies outside the tensor {list(shape)}",
                              path=path, entry=info.name)
        total += numel(c.sizes)
    live = [c for c in info.chunks if numel(c.sizes)]
    for i, a in enumerate(live):
        for b in live[i + 1:]:
            if all(ao < bo + bs and bo < ao + as_ for ao, as_, bo, bs in zip(a.offsets, a.sizes, b.offsets, b.sizes)):
                raise FormatError(f"chunks at {list(a.offsets)} and {list(b.offsets)} overlap", path=path,
                                  entry=info.name)
    if total != numel(shape):
        raise FormatError(f"chunks hold {total} of the tensor's {numel(shape)} elements", path=path, entry=info.name)


class ChunkFiles:
    """The checkpoint's shard files: mmapckpt shards mapped, stock files read per item."""

    def __init__(self, root: str, rels: set[str], save_id: str | None) -> None:
        self.root = root
        self.shards: dict[str, Shard] = {}
        self.stock: dict[str, str] = {}
        for rel in sorted(rels):
            full = open_inside(root, rel)
            if not os.path.isfile(full):
                raise IncompleteCheckpointError("shard file named in the metadata is missing", path=full)
            if is_mmapckpt_shard(full):
                shard = Shard(full)
                sid = getattr(shard.header, "save_id", None)
                if None not in (sid, save_id) and sid != save_id:
                    raise IncompleteCheckpointError(
                        f"shard was written by save {sid}, but the metadata belongs to save {save_id}: "
                        "the checkpoint was replaced while it was being opened", path=full)
                self.shards[rel] = shard
            else:
                self.stock[rel] = full

    def chunk(self, info: EntryInfo, c: ChunkInfo) -> torch.Tensor:
        """The chunk as a CPU tensor: a view over the mapping, or a stock item loaded whole."""
        label = f"{info.name}@{list(c.offsets)}"
        shard = self.shards.get(c.file)
        if shard is None:
            t = load_tensor(self._read_stock(c, label), path=self.stock[c.file], entry=label).contiguous()
        else:
            e = self._entry(shard, info.name, c, c.offsets)
            if e.dtype != fmt.dtype_name(info.dtype):  # type: ignore[arg-type]
                raise FormatError(f"shard holds {e.dtype} but the metadata says {info.dtype}", path=shard.path,
                                  entry=label)
            t = shard.tensor(e)
        if t.dtype != info.dtype or tuple(t.shape) != c.sizes:
            raise SizeMismatchError(f"stored chunk is {t.dtype} {list(t.shape)}, the metadata says {info.dtype} "
                                    f"{list(c.sizes)}", path=os.path.join(self.root, c.file), entry=label)
        return t

    def object_bytes(self, info: EntryInfo) -> bytes:
        c = info.chunks[0]
        shard = self.shards.get(c.file)
        if shard is None:
            return self._read_stock(c, info.name)
        return shard.read_bytes(self._entry(shard, info.name, c, None))

    def _entry(self, shard: Shard, name: str, c: ChunkInfo, offsets: tuple[int, ...] | None) -> fmt.Entry:
        e = shard.entry(name, offsets)
        if (e.offset, e.length) != (c.file_offset, c.length):
            raise FormatError(f"metadata says bytes [{c.file_offset}, +{c.length}) but the shard header says "
                              f"[{e.offset}, +{e.length})", path=shard.path, entry=e.label)
        return e

    def _read_stock(self, c: ChunkInfo, label: str) -> bytes:
        path = self.stock[c.file]
        with open(path, "rb") as f:
            return bytes(read_item(f.fileno(), c.file_offset, c.length, path=path, entry=label))

    def advise(self, c: ChunkInfo, advice: int) -> None:
        """Pass a madvise hint for the chunk's pages (no-op for stock files)."""
        shard = self.shards.get(c.file)
        if shard is None or shard._mmap is None or not c.length:
            return
        start = c.file_offset - c.file_offset % mmap.PAGESIZE
        shard._mmap.madvise(advice, start, c.file_offset + c.length - start)

    def check_unchanged(self, chunks: Iterable[ChunkInfo]) -> None:
        """Raise TruncatedFileError if a mapped file holding one of ``chunks`` shrank since it was opened."""
        for rel in {c.file for c in chunks}:
            shard = self.shards.get(rel)
            if shard is not None:
                check_size_unchanged(shard)
