"""MmapReader: a DCP StorageReader over mapped shard files.

For each read item it builds the stored chunk as a view over the mapping,
narrows it to the requested hypercube (touching only those pages) and copies it
into the planner's target. Stock torch.save-format checkpoints are read too,
detected per shard file, so one reader serves both.
"""

from __future__ import annotations

import os
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from ..errors import CheckpointError, FormatError
from ..format.entries import paused_gc
from ..format.metadata import METADATA_NAME, find_metadata, read_metadata_file
from ..io.staging import DEFAULT_STAGING_BUFFERS, DEFAULT_STAGING_BYTES, StagingPool
from .compat import reader_compat
from .read_paths import FileReads

__all__ = ["MmapReader"]


class MmapReader(StorageReader):
    """Reads mmapckpt (and stock DCP) checkpoints for ``dcp.load``.

    Args:
        path: the checkpoint directory.
        thread_count: shard files read in parallel.
        verify: check each entry's CRC-32 before using it (reads every byte of the entries used).
        direct_reads: read contiguous regions bound for contiguous CPU targets with ``preadv``
            straight into the target (one stream on a cold file, threads on a cached one)
            instead of copying them out of the mapping, and read regions bound for accelerator
            targets straight into the pinned staging buffers; False always copies from the mapping.
        staging_bytes, staging_buffers: the pinned staging ring for accelerator targets
            (default 3 buffers of 32 MiB; see docs/lazy.md). Allocated on the first load
            into an accelerator, reused by every later load of this reader, freed by
            :meth:`close` or when the reader is dropped.
        _extension_registry: FileSystemReader's argument; only None (no stream transforms).

    Example:
        >>> import torch.distributed.checkpoint as dcp
        >>> sd = {"w": torch.empty(4)}
        >>> dcp.load(sd, storage_reader=MmapReader("/tmp/ckpt"))
    """

    #: Tests only: copy into CPU targets through the staging pipeline as into accelerator ones.
    _stage_cpu_targets = False

    def __init__(self, path: str | os.PathLike[str], *, thread_count: int = 1, verify: bool = False,
                 direct_reads: bool = True, staging_bytes: int = DEFAULT_STAGING_BYTES,
                 staging_buffers: int = DEFAULT_STAGING_BUFFERS, _extension_registry: Any = None) -> None:
        super().__init__()
        reader_compat(_extension_registry)
        if thread_count < 1:
            raise ValueError(f"thread_count must be >= 1, got {thread_count}")
        if staging_bytes < 1 or staging_buffers < 1:
            raise ValueError(f"need staging_bytes >= 1 and staging_buffers >= 1, got {staging_bytes}, "
                             f"{staging_buffers}")
        self.staging_bytes, self.staging_buffers = staging_bytes, staging_buffers
        self._pools: dict[torch.device, StagingPool] = {}
        #: the typed error of the last failed read_metadata (see mmapckpt.checkpoint_error)
        self.metadata_error: CheckpointError | None = None
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
        try:
            kind, md = read_metadata_file(find_metadata(self.path, kwargs.get("rank")))
        except CheckpointError as e:
            # dcp.load turns this into an AssertionError holding only the message (then tries the
            # rank-local metadata): keep the typed error of the first attempt for checkpoint_error().
            if self.metadata_error is None or kwargs.get("rank") is None:
                self.metadata_error = e
            raise
        self.metadata_error = None
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
        """Read every item of ``plan``; returns once every copy is complete and committed."""
        ok = False
        for pool in self._pools.values():  # kept from an earlier load: order this load's current stream first
            pool.begin()
        try:
            with paused_gc():  # thousands of small objects per load; see format/entries.paused_gc
                self._read_plan(plan, planner)
            ok = True
        finally:
            for pool in self._pools.values():  # accelerator copies: wait, then commit_tensor for each
                pool.flush(commit=ok)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _read_plan(self, plan: LoadPlan, planner: LoadPlanner) -> None:
        reads = FileReads(self.path, self.storage_data, self.state_dict_metadata, self.save_id,
                          self._metadata_kind, verify=self.verify, direct_reads=self.direct_reads,
                          pool_for=self._pool_for, stage_cpu=self._stage_cpu_targets)
        per_file: dict[str, list[ReadItem]] = {}
        for req in plan.items:
            info = reads.info(req.storage_index)
            per_file.setdefault(info.relative_path, []).append(req)
        jobs = [(rel, sorted(reqs, key=lambda r: self.storage_data[r.storage_index].offset))
                for rel, reqs in per_file.items()]
        if self.thread_count > 1 and len(jobs) > 1:
            with ThreadPoolExecutor(self.thread_count, thread_name_prefix="mmapckpt-read") as threads:
                list(threads.map(lambda j: reads.read_file(j[0], j[1], planner), jobs))
        else:
            for rel, reqs in jobs:
                reads.read_file(rel, reqs, planner)

    def _pool_for(self, device: torch.device) -> StagingPool:
        """This reader's staging ring for ``device``, made on first use and ordered after the caller's stream."""
        pool = self._pools.get(device)
        if pool is None:
            pool = self._pools[device] = StagingPool(device, staging_bytes=self.staging_bytes,
                                                     staging_buffers=self.staging_buffers)
            pool.begin()
        return pool

    def close(self) -> None:
        """Free the pinned staging buffers (a later load into an accelerator allocates them again)."""
        pools, self._pools = self._pools, {}
        for pool in pools.values():
            pool.close()

    @property
    def checkpoint_id(self) -> str:
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        s = os.fspath(checkpoint_id)
        return "://" not in s and os.path.isfile(os.path.join(s, METADATA_NAME))
