"""MmapReader: a DCP StorageReader over mapped shard files.

For each read item it builds the stored chunk as a view over the mapping,
narrows it to the requested hypercube (touching only those pages) and copies it
into the planner's target. Stock torch.save-format checkpoints are read too,
detected per shard file, so one reader serves both.
"""

from __future__ import annotations

import io
import os
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from . import format as fmt
from ._entries import paused_gc
from ._direct import DirectReads
from ._io import open_inside
from ._shard import Shard, check_size_unchanged, is_mmapckpt_shard
from ._stock import load_tensor, read_item
from .errors import (
    CheckpointError,
    CheckpointNotFoundError,
    FormatError,
    IncompleteCheckpointError,
    SizeMismatchError,
)
from .metafile import KIND_MMAPCKPT, METADATA_NAME, read_metadata_file

__all__ = ["MmapReader", "find_metadata"]


def find_metadata(path: str, rank: int | None = None) -> str:
    """The metadata file of the checkpoint at ``path``; raise if there is none committed."""
    name = METADATA_NAME if rank is None else f"__{rank}{METADATA_NAME}"
    meta = os.path.join(path, name)
    if os.path.isfile(meta):
        return meta
    if not os.path.isdir(path):
        raise CheckpointNotFoundError("no checkpoint directory here", path=path)
    if any(n.endswith(".distcp") or ".distcp.tmp-" in n for n in os.listdir(path)):
        raise IncompleteCheckpointError(
            f"incomplete checkpoint: shard files but no committed {name} (the save did not finish)", path=path)
    raise CheckpointNotFoundError(f"no checkpoint here (no {name})", path=path)


def _label(idx: MetadataIndex) -> str:
    return idx.fqn if idx.offset is None else f"{idx.fqn}@{list(idx.offset)}"


class MmapReader(StorageReader):
    """Reads mmapckpt (and stock DCP) checkpoints for ``dcp.load``.

    Args:
        path: the checkpoint directory.
        thread_count: shard files read in parallel.
        verify: check each entry's CRC-32 before using it (reads every byte of the entries used).
        direct_reads: read contiguous regions bound for contiguous CPU targets with ``preadv``
            straight into the target (one stream on a cold file, threads on a cached one)
            instead of copying them out of the mapping; False always copies from the mapping.

    Example:
        >>> import torch.distributed.checkpoint as dcp
        >>> sd = {"w": torch.empty(4)}
        >>> dcp.load(sd, storage_reader=MmapReader("/tmp/ckpt"))
    """

    def __init__(self, path: str | os.PathLike[str], *, thread_count: int = 1, verify: bool = False,
                 direct_reads: bool = True) -> None:
        super().__init__()
        if thread_count < 1:
            raise ValueError(f"thread_count must be >= 1, got {thread_count}")
        self.path = os.fspath(path)
        self.thread_count = thread_count
        self.verify = verify
        self.direct_reads = direct_reads
        self.storage_data: dict[MetadataIndex, _StorageInfo] = {}
        self.state_dict_metadata: dict[str, Any] = {}
        self.save_id: str | None = None  # of the metadata read; every mmapckpt shard must carry the same
        self._metadata_kind: str | None = None
        self.load_id = str(uuid.uuid4())

    # ------------------------------------------------------------------ DCP interface
    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self.storage_data = {}
        if checkpoint_id:
            self.path = os.fspath(checkpoint_id)
        self.load_id = str(uuid.uuid4())

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        kind, md = read_metadata_file(find_metadata(self.path, kwargs.get("rank")))
        # Shards of an mmapckpt checkpoint must be mmapckpt shards: a damaged magic is a
        # BadMagicError, never a reason to hand the bytes to torch.load as a stock shard.
        self._metadata_kind = kind
        if md.storage_meta is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if metadata.storage_data is None:
            raise FormatError("metadata has no storage data", path=self.path)
        self.storage_data = metadata.storage_data
        self.state_dict_metadata = metadata.state_dict_metadata
        self.save_id = getattr(metadata.storage_meta, "save_id", None)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        with paused_gc():  # thousands of small objects per load; see _entries.paused_gc
            self._read_plan(plan, planner)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _read_plan(self, plan: LoadPlan, planner: LoadPlanner) -> None:
        per_file: dict[str, list[ReadItem]] = {}
        for req in plan.items:
            info = self._info(req.storage_index)
            per_file.setdefault(info.relative_path, []).append(req)
        jobs = [(rel, sorted(reqs, key=lambda r: self.storage_data[r.storage_index].offset))
                for rel, reqs in per_file.items()]
        if self.thread_count > 1 and len(jobs) > 1:
            with ThreadPoolExecutor(self.thread_count, thread_name_prefix="mmapckpt-read") as pool:
                devices = [d for ds in pool.map(lambda j: self._read_file(j[0], j[1], planner), jobs) for d in ds]
        else:
            devices = [d for rel, reqs in jobs for d in self._read_file(rel, reqs, planner)]
        for dev in set(devices):  # copies to accelerators were issued non_blocking
            torch.get_device_module(dev).synchronize(dev)

    @property
    def checkpoint_id(self) -> str:
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        s = os.fspath(checkpoint_id)
        return "://" not in s and os.path.isfile(os.path.join(s, METADATA_NAME))

    # ------------------------------------------------------------------ internals
    def _info(self, idx: MetadataIndex) -> _StorageInfo:
        try:
            return self.storage_data[idx]
        except KeyError:
            raise FormatError("metadata has no storage record for this entry", path=self.path,
                              entry=_label(idx)) from None

    def _read_file(self, rel: str, reqs: list[ReadItem], planner: LoadPlanner) -> list[torch.device]:
        path = open_inside(self.path, rel)
        if not os.path.exists(path):
            raise IncompleteCheckpointError("shard file named in the metadata is missing", path=path,
                                  entry=_label(reqs[0].storage_index))
        if self._metadata_kind == KIND_MMAPCKPT or is_mmapckpt_shard(path):
            return self._read_mmapckpt(path, reqs, planner)
        return self._read_stock(path, reqs, planner)

    def _read_mmapckpt(self, path: str, reqs: list[ReadItem], planner: LoadPlanner) -> list[torch.device]:
        """Every chunk is placed by the metadata, agreeing with the shard header (Shard.view)."""
        shard = Shard(path, check_entries=False)
        if shard.save_id is not None and self.save_id not in (None, shard.save_id):
            raise IncompleteCheckpointError(
                f"shard was written by save {shard.save_id}, but the metadata read belongs to save "
                f"{self.save_id}: the checkpoint was replaced while it was being loaded", path=path)
        devices = []
        ranges = [(self.storage_data[r.storage_index].offset, self.storage_data[r.storage_index].length)
                  for r in reqs if r.type != LoadItemType.BYTE_IO and r.storage_index in self.storage_data]
        direct = DirectReads(shard, enabled=self.direct_reads and _defers_safely(planner), ranges=ranges)
        accept_view = getattr(planner, "accept_view", None)
        try:
            for req in reqs:
                idx, info = req.storage_index, self.storage_data[req.storage_index]
                if self.verify:
                    shard.verify(self._entry(shard, req, info))
                if req.type == LoadItemType.BYTE_IO:
                    _load_bytes(planner, req, shard.object_bytes(idx.fqn, info.offset, info.length), path)
                    continue
                dtype, sizes = self._chunk(idx, path)
                view = shard.view((idx.fqn, tuple(idx.offset)), info.offset, info.length, dtype, sizes)
                # Zero-copy hook (mmapckpt.ZeroCopyLoadPlanner): a planner with accept_view(req, view)
                # may keep the mapped view of the whole stored chunk instead of having it copied.
                if accept_view is not None and accept_view(req, view):
                    continue
                dev = self._copy(view, req, planner, path, direct=direct)
                if dev is not None:
                    devices.append(dev)
            for req, target in direct.run():
                planner.commit_tensor(req, target)
        finally:
            direct.close()
        check_size_unchanged(shard)
        return devices

    def _chunk(self, idx: MetadataIndex, path: str) -> tuple[torch.dtype, torch.Size]:
        """dtype and shape of the stored chunk ``idx`` names, from the metadata."""
        md = self.state_dict_metadata.get(idx.fqn)
        if isinstance(md, TensorStorageMetadata) and idx.offset is not None:
            for c in md.chunks:
                if c.offsets == idx.offset:
                    return md.properties.dtype, c.sizes
        raise FormatError("the metadata describes no such stored chunk", path=path, entry=_label(idx))

    def _entry(self, shard: Shard, req: ReadItem, info: _StorageInfo) -> fmt.Entry:
        """The shard header's entry for ``req``, which must agree with the metadata's record."""
        idx = req.storage_index
        e = shard.entry(idx.fqn, None if req.type == LoadItemType.BYTE_IO else tuple(idx.offset or ()))
        if (info.offset, info.length) != (e.offset, e.length):
            raise FormatError(f"metadata says bytes [{info.offset}, +{info.length}) but the shard header says "
                              f"[{e.offset}, +{e.length})", path=shard.path, entry=e.label)
        return e

    def _copy(self, src: torch.Tensor, req: ReadItem, planner: LoadPlanner, path: str,
              direct: DirectReads | None = None) -> torch.device | None:
        if any(req.storage_offsets) or req.lengths != src.size():
            try:
                src = narrow_tensor_by_index(src, req.storage_offsets, req.lengths)
            except (RuntimeError, IndexError) as e:
                raise SizeMismatchError(f"requested region {list(req.storage_offsets)}+{list(req.lengths)} is "
                                        f"outside the stored chunk {list(src.shape)}: {e}", path=path,
                                        entry=_label(req.storage_index)) from None
        target = planner.resolve_tensor(req).detach()
        if target.size() != src.size():
            raise SizeMismatchError(f"stored region has shape {list(src.size())} but the target has "
                                    f"{list(target.size())}", path=path, entry=_label(req.storage_index))
        if direct is not None and direct.take(src, target, req, _label(req.storage_index)):
            return None  # read by direct.run(), then committed
        on_device = target.device.type != "cpu"
        target.copy_(src, non_blocking=on_device)
        planner.commit_tensor(req, target)
        return target.device if on_device else None

    def _read_stock(self, path: str, reqs: list[ReadItem], planner: LoadPlanner) -> list[torch.device]:
        """A stock (torch.save per item) shard: each item is loaded with weights_only=True."""
        devices = []
        fd = os.open(path, os.O_RDONLY)
        try:
            for req in reqs:
                info = self.storage_data[req.storage_index]
                label = _label(req.storage_index)
                if getattr(info, "transform_descriptors", None):
                    raise FormatError("stream transforms are not supported", path=path, entry=label)
                buf = read_item(fd, info.offset, info.length, path=path, entry=label)
                if req.type == LoadItemType.BYTE_IO:
                    _load_bytes(planner, req, buf, path)
                    continue
                dev = self._copy(load_tensor(buf, path=path, entry=label), req, planner, path)
                if dev is not None:
                    devices.append(dev)
        finally:
            os.close(fd)
        return devices


def _load_bytes(planner: LoadPlanner, req: ReadItem, data: bytes, path: str) -> None:
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
                          entry=_label(req.storage_index)) from e


def _defers_safely(planner: LoadPlanner) -> bool:
    """Whether reads may be gathered and committed at the end of a file.

    True for DefaultLoadPlanner and subclasses that keep its resolve_tensor and
    commit_tensor: their targets are views of the state dict and committing does
    nothing. A planner of its own may hand out a staging buffer per item and move it
    in commit_tensor, so its items are copied one by one from the mapping, as before.
    """
    cls = type(planner)
    return (isinstance(planner, DefaultLoadPlanner) and cls.resolve_tensor is DefaultLoadPlanner.resolve_tensor
            and cls.commit_tensor is DefaultLoadPlanner.commit_tensor)
