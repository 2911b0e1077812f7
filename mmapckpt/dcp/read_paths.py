"""The read paths of MmapReader, per shard file and per format, through the checkpoint's storage.

An mmapckpt shard is mapped: each stored chunk becomes a view over the mapping,
narrowed to the requested region and copied into the planner's target (or read with
``preadv`` straight into it). Items stored through DCP stream transforms are decoded into
memory first. A stock shard holds one ``torch.save`` item per record, loaded with
``weights_only=True``.
"""

from __future__ import annotations

import io
import threading
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, Callable

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
)

from ..errors import CheckpointError, FormatError, SizeMismatchError
from ..format import layout as fmt
from ..format.metadata import KIND_MMAPCKPT
from ..format.stock import load_tensor
from ..format.transforms import StreamTransforms, decoded_limit
from ..io.staging import StagingPool
from ..reading.moves import Moves
from ..reading.shard import Shard, check_size_unchanged, encoded_bytes, file_save_id, open_named, shard_of
from ..storage.base import CheckpointStorage, StoredFile
from .bytes_read import BytesRead
from .fast_planner import FastLoadPlanner
from .records import StorageRecords
from .safetensors_metadata import KIND_SAFETENSORS
from .safetensors_reads import read_safetensors, safetensors_in

__all__ = ["FileReads", "Job", "label", "load_bytes", "read_plan"]

#: A tensor chunk's (dtype, sizes), as the metadata gives them.
Layout = tuple[torch.dtype, tuple[int, ...]]
#: An item of a plan with its storage record and, where the lookup of the record gave it, its chunk's layout.
Job = tuple[ReadItem, _StorageInfo, "Layout | None"]


def label(idx: MetadataIndex) -> str:
    """An entry's name in errors: ``fqn``, or ``fqn@[chunk offsets]``."""
    return idx.fqn if idx.offset is None else f"{idx.fqn}@{list(idx.offset)}"


class FileReads:
    """One load's reads: the metadata's records, and how to read the items of one shard file."""

    def __init__(self, storage: CheckpointStorage, storage_data: dict[MetadataIndex, _StorageInfo],
                 state_dict_metadata: dict[str, Any],
                 save_id: str | None, metadata_kind: str | None, *, verify: bool, direct_reads: bool,
                 pool_for: Callable[[torch.device], StagingPool], stage_cpu: bool = False,
                 transforms: StreamTransforms | None = None, counter: BytesRead | None = None) -> None:
        self.counter = counter if counter is not None else BytesRead()  # the reader's bytes_read
        #: where the checkpoint's files are (storage/base.py)
        self.storage, self.root = storage, storage.location
        self.storage_data, self.state_dict_metadata = storage_data, state_dict_metadata
        #: undoes the stream transforms of encoded items (the reader's ``_extension_registry``)
        self.transforms = transforms or StreamTransforms()
        self.save_id, self.metadata_kind, self.verify, self.direct_reads = save_id, metadata_kind, verify, direct_reads
        self.pool_for, self.stage_cpu = pool_for, stage_cpu  # the reader's staging pool, one per device
        #: MmapReader's index: per shard file its entries as placed (Shard.agrees), made for the first shard opened
        self._placed: dict[str, list[tuple[Any, ...]]] | None = None
        self._placed_lock = threading.Lock()

    def job(self, req: ReadItem) -> Job:
        """``req`` with its storage record and, from MmapReader's index, its chunk's layout (one lookup)."""
        sd = self.storage_data
        if type(sd) is StorageRecords:
            found = sd.located(req.storage_index)
            if found is not None:
                return req, found[0], found[1]
        return req, self.info(req.storage_index), None

    def info(self, idx: MetadataIndex) -> _StorageInfo:
        sd = self.storage_data
        found = sd.info(idx) if type(sd) is StorageRecords else sd.get(idx)  # MmapReader's: no other record built
        if found is None:
            raise FormatError("metadata has no storage record for this entry", path=self.root, entry=label(idx))
        return found

    def open_file(self, rel: str, entry: str | None = None) -> StoredFile:
        """Shard file ``rel``, opened as every reader opens it (reading/shard.py ``open_named``): a file the
        metadata names but the location lacks raises IncompleteCheckpointError."""
        return open_named(self.storage, rel, self.save_id, entry)

    def open_shard(self, f: StoredFile, rel: str = "") -> Shard | None:
        """The mmapckpt shard ``f`` (file ``rel``) holds (its header read, not yet every entry checked; a shard of
        another save refused: a sibling step's, of a cross-step reference, by the save id the metadata records
        for it), or None for a stock file (reading/shard.py ``shard_of``)."""
        ref = rel.startswith("../")
        return shard_of(f, file_save_id(self.save_id, rel), stock=self.metadata_kind != KIND_MMAPCKPT and not ref,
                        referenced=ref, records=self._records_of(rel))

    def _records_of(self, rel: str) -> list[tuple[Any, ...]] | None:
        """The entries of file ``rel`` as MmapReader's index places them, or None for other metadata.

        A shard whose header is exactly what was written for them (its checksum holding) is then not
        decoded, and the views of its chunks check only their bounds (reading/shard.py ``Shard.agrees``,
        as ``load_into`` opens shards): on 10,000 entries that is less than the header's decode and a
        check of each entry against it. A header that does not agree is decoded and checked as before.
        """
        sd = self.storage_data
        if type(sd) is not StorageRecords:
            return None
        with self._placed_lock:  # files may be opened on several threads (thread_count)
            if self._placed is None:
                self._placed = sd.records_by_file()
        return self._placed.get(rel)

    def read_file(self, rel: str, reqs: list[Job], planner: LoadPlanner) -> None:
        """Read the items of one shard file, each with its storage record (resolved once, by read_plan)."""
        with self.open_file(rel, label(reqs[0][0].storage_index)) as f:
            shard = self.open_shard(f, rel)
            memory = self.memory_moves()  # for items decoded or loaded into memory first
            ok = False
            try:
                if shard is not None:
                    self._read_mmapckpt(shard, reqs, planner, memory)
                else:
                    self._read_stock(f, reqs, planner, memory)
                ok = True
            finally:
                memory.close(ok=ok)

    def memory_moves(self) -> Moves:
        """The moves of sources in memory (not views of a file) into this load's targets (reading/moves.py)."""
        return Moves(None, pool_for=self.pool_for, stage_all=self.stage_cpu)

    def _read_mmapckpt(self, shard: Shard, reqs: list[Job], planner: LoadPlanner, memory: Moves) -> None:
        """Every chunk is placed by the metadata, agreeing with the shard header (Shard.view)."""
        path = shard.path
        ranges = [(info.offset, info.length) for r, info, _ in reqs
                  if r.type != _BYTE_IO and not getattr(info, "transform_descriptors", None)]
        # Reads straight into the targets (CPU; gathered and run at the end of the file) or into
        # the staging buffers (accelerators) instead of copying out of the mapping. Only for
        # planners whose commit_tensor does nothing: a planner of its own keeps the mapped path.
        defer = _defers_safely(planner)
        moves = Moves(shard.source, read=self.direct_reads and defer, ranges=ranges, pool_for=self.pool_for,
                      stage_all=self.stage_cpu)
        accept_view = getattr(planner, "accept_view", None)
        ok = False
        taken: list[tuple[int, int, int | None]] = []  # for the byte counter, under one lock at the end
        try:
            _read_items(self, shard, reqs, planner, moves, memory, defer, accept_view, taken)
            moves.finish()
            ok = True
        finally:
            moves.close(ok=ok)
            self.counter.take_all(path, taken)
        check_size_unchanged(shard)

    def _read_one(self, shard: Shard, req: ReadItem, info: _StorageInfo, layout: Layout | None, planner: LoadPlanner,
                  moves: Moves, memory: Moves, defer: bool, accept_view: Any,
                  taken: list[tuple[int, int, int | None]]) -> None:
        """One item of an mmapckpt shard: checked, then copied (or queued, or staged, or kept as a view)."""
        idx = req.storage_index
        if self.verify:
            shard.verify(_header_entry(shard, req, info))
            taken.append((info.offset, info.length, None))
        if layout is None or req.type == _BYTE_IO:  # not a tensor chunk whose layout came with its record
            if getattr(info, "transform_descriptors", None):
                taken.append((info.offset, info.length, None))
                return _read_encoded(self, shard, req, info, planner, memory)
            if req.type == _BYTE_IO:
                load_bytes(planner, req, shard.object_bytes(idx.fqn, info.offset, info.length), shard.path)
                taken.append((info.offset, info.length, None))
                return None
            layout = self.chunk_layout(idx, shard.path)
        dtype, sizes = layout
        # Unmapped (an object): a placeholder the moves read from the file (reading/fetches.py).
        lazy = shard.file is None and defer
        view = shard.view((idx.fqn, tuple(idx.offset)), info.offset, info.length, dtype, sizes, lazy=lazy)
        # Zero-copy hook (mmapckpt.ZeroCopyLoadPlanner): a planner with accept_view(req, view)
        # may keep the mapped view of the whole stored chunk instead of having it copied.
        if accept_view is not None:
            if lazy:  # no mapping to keep a view of: the chunk read into memory is offered instead
                view = moves.fetches.materialize(view)  # type: ignore[union-attr]
            if accept_view(req, view):
                return None  # not read here: the planner keeps the mapped view
        taken.append((info.offset, info.length, _region_bytes(req, dtype)))
        self.copy_region(view, req, planner, shard.path, moves, defer)

    def chunk_layout(self, idx: MetadataIndex, path: str) -> tuple[torch.dtype, tuple[int, ...]]:
        """dtype and shape of the stored chunk ``idx`` names, from the metadata."""
        found = _stored_chunk(self.storage_data, self.state_dict_metadata, idx) if idx.offset is not None else None
        if found is None:
            raise FormatError("the metadata describes no such stored chunk", path=path, entry=label(idx))
        return found

    def copy_region(self, src: torch.Tensor, req: ReadItem, planner: LoadPlanner, path: str, moves: Moves,
                    defer: bool = False, target: torch.Tensor | None = None) -> None:
        """Narrow stored chunk ``src`` to the region ``req`` asks for and move it into the planner's target
        (by the strategy ``moves`` picks for it; committed once it is there)."""
        if any(req.storage_offsets) or req.lengths != src.size():
            try:
                src = narrow_tensor_by_index(src, req.storage_offsets, req.lengths)
            except (RuntimeError, IndexError) as e:
                raise SizeMismatchError(f"requested region {list(req.storage_offsets)}+{list(req.lengths)} is "
                                        f"outside the stored chunk {list(src.shape)}: {e}", path=path,
                                        entry=label(req.storage_index)) from None
        if target is None:
            target = planner.resolve_tensor(req)
            # As the stock reader, commit a detached target; DefaultLoadPlanner's commit_tensor
            # ignores it, so there (defer) only a target that requires grad needs detaching.
            if not defer or target.requires_grad:
                target = target.detach()
        if target.size() != src.size():
            raise SizeMismatchError(f"stored region has shape {list(src.size())} but the target has "
                                    f"{list(target.size())}", path=path, entry=label(req.storage_index))
        moves.move(src, target, lambda: label(req.storage_index), lambda: planner.commit_tensor(req, target))

    def _read_stock(self, f: StoredFile, reqs: list[Job], planner: LoadPlanner, memory: Moves) -> None:
        """A stock (torch.save per item) shard: each item is loaded with weights_only=True; tensors stored as
        safetensors data (a Hugging Face file, a SAFETENSORS-format shard) are mapped (dcp/safetensors_reads.py)."""
        path = f.path
        whole = self.metadata_kind == KIND_SAFETENSORS
        tensors = [(r, info) for r, info, _ in reqs if r.type != _BYTE_IO]
        st = safetensors_in(self, f, (tensors[0][0].storage_index, tensors[0][1]) if tensors else None, whole)
        if st is not None:
            read_safetensors(self, st, tensors, planner, memory, defer=_defers_safely(planner), whole_file=whole)
            reqs = [j for j in reqs if j[0].type == _BYTE_IO]
        for req, info, _ in reqs:
            name = label(req.storage_index)
            buf = f.read(info.offset, info.length, entry=name)
            self.counter.take(path, info.offset, info.length)
            if getattr(info, "transform_descriptors", None):  # FileSystemWriter(_extensions=...)
                buf = self.transforms.decode(buf, info.transform_descriptors, path=path, entry=name,
                                             limit=_stock_decode_limit(self, req))  # type: ignore[assignment]
            if req.type == LoadItemType.BYTE_IO:
                load_bytes(planner, req, buf, path)
                continue
            self.copy_region(load_tensor(buf, path=path, entry=name), req, planner, path, memory)


def _read_items(reads: FileReads, shard: Shard, reqs: list[Job], planner: LoadPlanner, moves: Moves, memory: Moves,
                defer: bool, accept_view: Any, taken: list[tuple[int, int, int | None]]) -> None:
    """The walk of one mmapckpt shard's items (``FileReads._read_mmapckpt``).

    The items most loads are made of are walked here without ``_read_one``'s other cases: a tensor
    chunk whose layout came with its record (MmapReader's index), for a planner that resolves as
    DCP's and commits nothing, whole into a target of its shape. The rest, and every error, take
    the general path.
    """
    plain = defer and accept_view is None and not reads.verify
    lazy, path = shard.file is None, shard.path
    view, move, resolve, commit = shard.view, moves.move, planner.resolve_tensor, planner.commit_tensor
    for req, info, layout in reqs:
        if layout is None or not plain or req.type is _BYTE_IO:
            reads._read_one(shard, req, info, layout, planner, moves, memory, defer, accept_view, taken)
            continue
        idx = req.storage_index
        dtype, sizes = layout
        src = view((idx.fqn, idx.offset), info.offset, info.length, dtype, sizes, lazy=lazy)  # Size keys as tuple
        taken.append((info.offset, info.length, _region_bytes(req, dtype)))
        if req.lengths != sizes or any(req.storage_offsets):
            reads.copy_region(src, req, planner, path, moves, True)  # a region of the chunk
            continue
        target = resolve(req)
        if target.requires_grad:
            target = target.detach()
        if target.size() != sizes:
            reads.copy_region(src, req, planner, path, moves, True, target)  # raises SizeMismatchError
        move(src, target, partial(label, idx), partial(commit, req, target))


def _bytes_of(t: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's memory as writable bytes."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else memoryview(bytearray())


def _read_encoded(reads: FileReads, shard: Shard, req: ReadItem, info: _StorageInfo, planner: LoadPlanner,
                  memory: Moves) -> None:
    """Read one item of an mmapckpt shard stored through DCP stream transforms (``_extension_registry``).

    Such items cannot be mapped: they are decoded into memory (straight into the target when a
    whole chunk goes to a contiguous CPU target of its dtype), then narrowed and copied as a
    mapped chunk is.
    """
    idx, name = req.storage_index, label(req.storage_index)
    key = (idx.fqn, None if req.type == LoadItemType.BYTE_IO else tuple(idx.offset or ()))
    stored, descriptors = encoded_bytes(shard, key, info.offset, info.length)
    if list(descriptors) != list(info.transform_descriptors):
        raise FormatError(f"metadata says the item went through {list(info.transform_descriptors)}, the shard "
                          f"header says {list(descriptors)}", path=shard.path, entry=name)
    decode: Any = reads.transforms.decode
    if req.type == LoadItemType.BYTE_IO:
        load_bytes(planner, req, decode(stored, descriptors, path=shard.path, entry=name), shard.path)
        return None
    dtype, sizes = reads.chunk_layout(idx, shard.path)
    target = planner.resolve_tensor(req).detach()
    whole = not any(req.storage_offsets) and tuple(req.lengths) == tuple(sizes)
    if (whole and not reads.stage_cpu and target.device.type == "cpu" and target.dtype == dtype
            and tuple(target.shape) == tuple(sizes) and target.is_contiguous() and target.numel()):
        decode(stored, descriptors, path=shard.path, entry=name, into=_bytes_of(target))
        planner.commit_tensor(req, target)
        return None
    buf = torch.empty(sizes, dtype=dtype)
    decode(stored, descriptors, path=shard.path, entry=name, into=_bytes_of(buf))
    reads.copy_region(buf, req, planner, shard.path, memory, target=target)


def _stock_decode_limit(reads: FileReads, req: ReadItem) -> int:
    """The most bytes a transformed stock item may decode to: its chunk's bytes plus torch.save's framing."""
    stored = reads.storage_data[req.storage_index].length
    if req.type == LoadItemType.BYTE_IO:
        return decoded_limit(stored)
    dtype, sizes = reads.chunk_layout(req.storage_index, reads.root)
    return sizes.numel() * torch._utils._element_size(dtype) + (16 << 20)


def _stored_chunk(storage_data: Any, sdm: Any, idx: MetadataIndex) -> tuple[torch.dtype, tuple[int, ...]] | None:
    """(dtype, shape) of the stored tensor chunk ``idx`` names, or None: from MmapReader's index
    (records.py, no DCP record built) or from DCP's records."""
    if type(storage_data) is StorageRecords:
        found = storage_data.chunk(idx)
        return None if found is None or found[0].kind != "tensor" else (found[0].dtype, found[1].sizes)
    md = sdm.get(idx.fqn)
    if isinstance(md, TensorStorageMetadata):
        hint = idx.index  # the chunk's place in the list, where the planner set it
        if hint is not None and 0 <= hint < len(md.chunks) and md.chunks[hint].offsets == idx.offset:
            return md.properties.dtype, md.chunks[hint].sizes
        for c in md.chunks:
            if c.offsets == idx.offset:
                return md.properties.dtype, c.sizes
    return None


def read_plan(reads: FileReads, plan: LoadPlan, planner: LoadPlanner, thread_count: int) -> None:
    """Read every item of ``plan``, file by file in offset order (``thread_count`` files at a time)."""
    per_file: dict[str, list[Job]] = {}
    job = reads.job
    for req in plan.items:  # each record looked up once: hashing a MetadataIndex is not free
        j = job(req)
        rel = j[1].relative_path
        group = per_file.get(rel)
        if group is None:
            group = per_file[rel] = []
        group.append(j)
    jobs = [(rel, sorted(reqs, key=_offset)) for rel, reqs in per_file.items()]
    if thread_count > 1 and len(jobs) > 1:
        with ThreadPoolExecutor(thread_count, thread_name_prefix="mmapckpt-read") as threads:
            list(threads.map(lambda j: reads.read_file(j[0], j[1], planner), jobs))
    else:
        for rel, reqs in jobs:
            reads.read_file(rel, reqs, planner)


def _header_entry(shard: Shard, req: ReadItem, info: _StorageInfo) -> fmt.Entry:
    """The shard header's entry for ``req``, which must agree with the metadata's record."""
    idx = req.storage_index
    e = shard.entry(idx.fqn, None if req.type == LoadItemType.BYTE_IO else tuple(idx.offset or ()))
    if (info.offset, info.length) != (e.offset, e.length):
        raise FormatError(f"metadata says bytes [{info.offset}, +{info.length}) but the shard header says "
                          f"[{e.offset}, +{e.length})", path=shard.path, entry=e.label)
    return e


_BYTE_IO = LoadItemType.BYTE_IO


def _offset(job: Job) -> int:
    return job[1].offset


def _region_bytes(req: ReadItem, dtype: torch.dtype) -> int:
    """The bytes of the hypercube ``req`` takes out of its stored chunk."""
    n = dtype.itemsize
    for s in req.lengths:
        n *= s
    return n


def load_bytes(planner: LoadPlanner, req: ReadItem, data: bytes, path: str) -> None:
    """Hand a stored non-tensor value to the planner, which deserializes it (DCP's: ``torch.load``).

    Bytes that do not deserialize (a damaged item, or stock metadata pointing at the wrong
    bytes: it has no checksum) raise FormatError naming the file and entry, not torch's error.
    """
    try:
        planner.load_bytes(req, io.BytesIO(data))
    except CheckpointError:
        raise
    except Exception as e:
        raise FormatError(f"the stored value could not be deserialized: {type(e).__name__}: {e}"[:500], path=path,
                          entry=label(req.storage_index)) from e


def _defers_safely(planner: LoadPlanner) -> bool:
    """Whether reads may be gathered and committed at the end of a file.

    True for DefaultLoadPlanner and subclasses that keep its resolve_tensor (or
    FastLoadPlanner's, which resolves as it does) and commit_tensor: their targets are views of the state dict and committing does
    nothing. A planner of its own may hand out a staging buffer per item and move it
    in commit_tensor, so its items are copied one by one from the mapping, as before.
    """
    cls = type(planner)
    return (isinstance(planner, DefaultLoadPlanner) and cls.commit_tensor is DefaultLoadPlanner.commit_tensor
            and cls.resolve_tensor in (DefaultLoadPlanner.resolve_tensor, FastLoadPlanner.resolve_tensor))
