"""MmapReader: a DCP StorageReader over mapped shard files.

For each read item it builds the stored chunk as a view over the mapping,
narrows it to the requested hypercube (touching only those pages) and copies it
into the planner's target. Stock checkpoints are read too, detected per shard file
(torch.save items, or safetensors data: dcp/safetensors_reads.py), and so are Hugging Face
safetensors directories, whose metadata is made from their headers (dcp/safetensors_metadata.py).
"""

from __future__ import annotations

import dataclasses
import os
import uuid
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from ..errors import CheckpointError, CheckpointNotFoundError, FormatError
from ..format.entries import paused_gc
from ..format.metadata import METADATA_NAME
from ..storage.base import CheckpointStorage
from ..storage.credentials import StorageOptions
from ..storage.location import storage_for
from ..io.staging import DEFAULT_STAGING_BUFFERS, DEFAULT_STAGING_BYTES, StagingPool
from .bytes_read import BytesRead
from .compat import reader_compat
from .deliver import load_plan
from .metadata import read_metadata
from .read_once import DEFAULT_MIN_SHARE, DEFAULT_PIECE_BYTES, ReadOnceOptions, local_info, plan_read_once
from .read_paths import FileReads
from ..reading.formats import recognise, resolve
from ..reading.located import Place, locate
from ..storage.location import is_url

__all__ = ["MmapReader", "committed_metadata"]


def committed_metadata(storage: CheckpointStorage, path: str, rank: int | None = None) -> tuple[str, Metadata]:
    """The DCP metadata of a DCP directory (mmapckpt or stock): its commit (``.metadata``, or the rank's
    ``__{rank}.metadata``), decoded lazily; the format table's ``dcp_metadata`` of those formats."""
    return read_metadata(storage, storage.find_metadata(rank), lazy=True)


def _place_of(storage: CheckpointStorage, path: str) -> Place | None:
    """The directory ``storage`` serves, or the file ``path`` names (None: nothing there)."""
    if storage.is_location():
        return Place(path, storage, None, not is_url(path))
    try:
        return locate(path)
    except CheckpointError:
        return None


def _table_metadata(storage: CheckpointStorage, path: str, rank: int | None) -> tuple[str, Metadata]:
    """The DCP metadata of a directory without a commit, as its format's record builds it (a Hugging Face
    directory: from its safetensors headers, dcp/safetensors_metadata.py)."""
    place = _place_of(storage, path)
    if place is None:
        storage.find_metadata(rank)  # raises what is missing
    fmt = recognise(place)  # type: ignore[arg-type]
    if fmt.dcp_metadata is None:
        raise CheckpointNotFoundError(f"MmapReader (dcp.load) cannot read a {fmt.what}: open or load it with "
                                      "mmapckpt.open/load/load_into, or convert it (`mmapckpt convert SRC DST`)",
                                      path=path)
    return fmt.resolved("dcp_metadata")(storage, path, rank)  # type: ignore[no-any-return]


class MmapReader(StorageReader):
    """Reads mmapckpt checkpoints, stock DCP ones (torch.save or safetensors format) and Hugging Face
    safetensors directories (as ``HuggingFaceStorageReader`` does: dcp/safetensors_metadata.py) for ``dcp.load``.

    Args:
        path: the checkpoint directory, or an object-store prefix ``s3://BUCKET/PREFIX``
            (docs/object-storage.md).
        thread_count: shard files read in parallel.
        verify: check each entry's CRC-32 before using it (reads every byte of the entries used).
        direct_reads: read regions bound for contiguous CPU targets with ``preadv`` straight into
            them, and those bound for accelerators into the staging buffers; False copies from the mapping.
        staging_bytes: the size of each buffer of the pinned staging ring for accelerator targets
            (docs/lazy.md): allocated on the first load into one, reused, freed by :meth:`close`.
        staging_buffers: the number of buffers in that ring.
        _extension_registry: the ``ExtensionRegistry`` that undoes stream transforms (default:
            DCP's, which knows ``ZStandard``), as FileSystemReader; such items are decoded, not mapped.
        read_once: read each stored record several ranks need on one of them and send it to the others
            in pieces (docs/lazy.md "Read-once").
        read_once_group: the process group it sends over: ``dcp.load``'s (None: the world).
        read_once_piece_bytes: the size of each piece sent.
        read_once_min_share: read once only if at least this fraction of the bytes asked for is shared.
        storage_options: settings of an object store's client (credentials, endpoint, request sizes;
            docs/object-storage.md), overriding the ``AWS_*`` environment; ignored for a local path.

    Example:
        >>> import torch.distributed.checkpoint as dcp
        >>> sd = {"w": torch.empty(4)}
        >>> dcp.load(sd, storage_reader=MmapReader("/tmp/ckpt"))
    """

    #: Tests only: copy into CPU targets through the staging pipeline as into accelerator ones.
    _stage_cpu_targets = False

    def __init__(self, path: str | os.PathLike[str], *, thread_count: int = 1, verify: bool = False,
                 direct_reads: bool = True, staging_bytes: int = DEFAULT_STAGING_BYTES,
                 staging_buffers: int = DEFAULT_STAGING_BUFFERS, _extension_registry: Any = None,
                 read_once: bool = False, read_once_group: Any = None, read_once_piece_bytes: int = DEFAULT_PIECE_BYTES,
                 read_once_min_share: float = DEFAULT_MIN_SHARE,
                 storage_options: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        self.transforms = reader_compat(_extension_registry)
        if thread_count < 1:
            raise ValueError(f"thread_count must be >= 1, got {thread_count}")
        if staging_bytes < 1 or staging_buffers < 1:
            raise ValueError(f"need staging_bytes >= 1 and staging_buffers >= 1, got {staging_bytes}, "
                             f"{staging_buffers}")
        self.read_once = ReadOnceOptions(read_once, read_once_group, read_once_piece_bytes, read_once_min_share)
        self._bytes = BytesRead()
        self.staging_bytes, self.staging_buffers = staging_bytes, staging_buffers
        self._pools: dict[torch.device, StagingPool] = {}
        #: the typed error of the last failed read_metadata (see mmapckpt.checkpoint_error)
        self.metadata_error: CheckpointError | None = None
        self.path = os.fspath(path)
        self.storage_options = StorageOptions(storage_options)  # shown redacted (storage/credentials.py)
        self._storage: tuple[str, CheckpointStorage, str] | None = None
        self.thread_count = thread_count
        self.verify = verify
        self.direct_reads = direct_reads
        self.storage_data: dict[MetadataIndex, _StorageInfo] = {}
        self.state_dict_metadata: dict[str, Any] = {}
        self.save_id: str | None = None  # of the metadata read; every mmapckpt shard must carry the same
        self._metadata_kind: str | None = None
        self.load_id = str(uuid.uuid4())

    @property
    def storage(self) -> CheckpointStorage:
        """Where the checkpoint read lives (storage/base.py)."""
        return self._resolved()[1]

    def _resolved(self) -> tuple[str, CheckpointStorage]:
        """(where the checkpoint is, its storage): the path, or the place the format table resolves it to (a hub
        cache repository root: the snapshot ``refs/main`` names, as ``open``/``load`` read it)."""
        # one per checkpoint and load or save (reset() starts another): what it found of the files is kept
        if self._storage is None or self._storage[0] != self.path:
            path, storage = self.path, storage_for(self.path, options=self.storage_options)
            if not is_url(path) and storage.is_location():
                place = resolve(Place(path, storage, None, True))
                path, storage = place.path, place.storage
            self._storage = (self.path, storage, path)
        return self._storage[2], self._storage[1]

    def __repr__(self) -> str:
        options = f", storage_options={self.storage_options!r}" if self.storage_options else ""
        return f"MmapReader({self.path!r}{options})"

    # ------------------------------------------------------------------ DCP interface
    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self.storage_data = {}
        if checkpoint_id:
            self.path = os.fspath(checkpoint_id)
        self._storage = None
        self.load_id = str(uuid.uuid4())

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        try:
            path, storage = self._resolved()
            try:
                kind, md = committed_metadata(storage, path, kwargs.get("rank"))
            except CheckpointNotFoundError:  # no commit: what the format table finds here (reading/formats.py)
                kind, md = _table_metadata(storage, path, kwargs.get("rank"))
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
        return dataclasses.replace(plan, storage_data=local_info()) if self.read_once.enabled else plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plan_read_once(plans, self.storage_data, self.read_once.min_share) if self.read_once.enabled else plans

    @property
    def bytes_read(self) -> int:
        """The bytes the last load took from checkpoint files on this rank (each stored byte once)."""
        return self._bytes.total

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read every item of ``plan``; returns once every copy is complete and committed."""
        ok = False
        for pool in self._pools.values():  # kept from an earlier load: order this load's current stream first
            pool.begin()
        try:
            with paused_gc():  # thousands of small objects per load; see format/entries.paused_gc
                load_plan(plan, planner, self._new_load(), self.read_once, self.thread_count)
            ok = True
        finally:
            for pool in self._pools.values():  # accelerator copies: wait, then commit_tensor for each
                pool.flush(commit=ok)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _new_load(self) -> FileReads:
        self._bytes = BytesRead()
        return FileReads(self.storage, self.storage_data, self.state_dict_metadata, self.save_id,
                         self._metadata_kind, verify=self.verify, direct_reads=self.direct_reads,
                         pool_for=self._pool_for, stage_cpu=self._stage_cpu_targets, transforms=self.transforms,
                         counter=self._bytes)

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
        try:
            storage = storage_for(s)
            return storage.exists(METADATA_NAME) or _place_of(storage, s) is not None and \
                recognise(_place_of(storage, s)).dcp_metadata is not None  # e.g. a Hugging Face directory
        except CheckpointError:
            return False
