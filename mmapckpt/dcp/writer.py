"""MmapWriter: a DCP StorageWriter that writes raw, aligned tensor bytes.

It plans which items go to which shard file, has shard_writer.py write each file, and
commits the metadata; it records (file, offset, length) for every item in the storage
data, like the stock writer, so that any DCP planner works unchanged.
"""

from __future__ import annotations

import dataclasses
import os
import uuid
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from ..errors import CheckpointWriteError
from ..format.metadata import check_user_metadata
from ..format.metadata.written import DCP_VERSION
from .compat import writer_compat
from ..storage.base import CheckpointStorage, Lock
from ..storage.commits import begin_save, commit_save, existing_shards, metadata_name, shard_name
from ..storage.local import writable_local_path
from ..storage.credentials import StorageOptions
from ..storage.location import is_url, storage_for
from ..writing.dedup import ReuseIndex
from ..writing.files import how_written, split_by_size
from .reuse import HeaderCache, references, save_index
from .shard_writer import WriterOptions, chunk_nbytes, write_files

__all__ = ["MmapWriter", "WriterOptions"]


@dataclass(frozen=True)
class _Prefix:
    prefix: str
    save_id: str  # the coordinator's save id, written into every shard header
    avoid: frozenset[str] = frozenset()  # shard files with this prefix in the directory: taken names


def _with_prefixes(plans: list[SavePlan], save_id: str, used: set[str]) -> list[SavePlan]:
    """Each rank's plan with its file prefix ``__{rank}_``, the save id and the names it must avoid."""
    out = []
    for i, p in enumerate(plans):
        if p.storage_data is None:
            prefix = f"__{i}_"
            p = dataclasses.replace(p, storage_data=_Prefix(
                prefix, save_id, frozenset(n for n in used if n.startswith(prefix))))
        out.append(p)
    return out


def _split_into_files(n: int, items: list[WriteItem]) -> list[list[WriteItem]]:
    """Spread items over ``n`` files of similar byte counts (writing/files.py ``split_by_size``)."""
    sizes = [None if it.type == WriteItemType.BYTE_IO else chunk_nbytes(it) for it in items]
    return [[items[i] for i in group] for group in split_by_size(n, sizes)]


class MmapWriter(StorageWriter):
    """Writes a DCP checkpoint as raw, aligned tensor bytes behind a JSON header.

    Args:
        path: the checkpoint directory (created if missing), or an object-store prefix
            ``s3://BUCKET/PREFIX`` (docs/object-storage.md).
        thread_count: files written in parallel per rank (one shard file each).
        sync_files: fsync every shard and the directory before the metadata commit.
        alignment: data offset alignment for entries at least this long (power of two >= 64).
        overwrite: allow replacing an existing checkpoint in ``path``.
        direct_io: write shards with O_DIRECT through page-aligned bounce buffers, bypassing
            the page cache (on a disk whose buffered write path is CPU-bound this saves two to
            three times faster; the saved files are then not in the page cache). Where the
            filesystem refuses O_DIRECT (tmpfs, some network filesystems) the shard is written
            buffered instead, automatically. ``write_paths`` records which path each shard took.
        metadata: user metadata ``{str: str}`` (as safetensors' ``save_file(metadata=)``), kept in ``.metadata``.
        storage_options: settings of an object store's client (credentials, endpoint, part sizes;
            docs/object-storage.md), overriding the ``AWS_*`` environment; ignored for a local path.
        _extensions: DCP stream transforms (``ZStandard()``, encryption, your own
            ``StreamTransformExtension``) that every item is written through, as with
            FileSystemWriter. Such items are stored encoded: loads decode them into memory
            instead of mapping them, and only ``dcp.load`` with MmapReader reads them (its
            ``_extension_registry`` must know any transform of your own).
        single_file_per_rank: FileSystemWriter's, as the next three: False writes one file per item.
        per_thread_copy_ahead: accepted; copies from accelerators run ahead in the writer's own staging.
        cache_staged_state_dict: only False is accepted; True is refused with what to use instead.
        serialization_format: only the default is accepted; others are refused with what to use instead.
        reuse: committed sibling steps ``ROOT/step-{M}`` of a managed root whose chunks this save may refer to
            instead of writing equal ones again (dcp/reuse.py; docs/format.md 3.4; needs ``blake3``).
        _reuse_cache: the shard headers earlier saves read for ``reuse`` (``CheckpointManager`` keeps one).

    Example:
        >>> import torch.distributed.checkpoint as dcp
        >>> dcp.save({"w": torch.ones(4)}, storage_writer=MmapWriter("/tmp/ckpt"), no_dist=True)
    """

    def __init__(self, path: str | os.PathLike[str], *, thread_count: int = 1, sync_files: bool = True,
                 alignment: int = 4096, overwrite: bool = True, direct_io: bool = True,
                 single_file_per_rank: bool = True, per_thread_copy_ahead: int = 10_000_000,
                 cache_staged_state_dict: bool = False, _extensions: Any = None,
                 serialization_format: Any = None, metadata: Mapping[str, str] | None = None,
                 storage_options: Mapping[str, Any] | None = None, reuse: Sequence[str | os.PathLike[str]] = (),
                 _reuse_cache: HeaderCache | None = None) -> None:
        super().__init__()
        transforms = writer_compat(single_file_per_rank, per_thread_copy_ahead, cache_staged_state_dict,
                                   _extensions, serialization_format)
        self.single_file_per_rank = single_file_per_rank
        self.path = os.fspath(path)
        self.storage_options = StorageOptions(storage_options)  # shown redacted (storage/credentials.py)
        self._storage: tuple[str, CheckpointStorage] | None = None
        self.storage  # a URL of no medium (or bad storage_options) is refused here, before any plan
        self.options = WriterOptions(thread_count, sync_files, alignment, overwrite, direct_io, transforms)
        self.user_metadata = check_user_metadata(metadata)  # TypeError before any file is touched
        if isinstance(reuse, (str, os.PathLike)):
            raise TypeError("reuse= takes a list of step paths, not one path")
        self.reuse = [os.fspath(p) for p in reuse]
        if self.reuse and transforms is not None:
            raise ValueError("reuse= compares raw chunks: it cannot be combined with _extensions")
        self._reuse_index: ReuseIndex | None = None  # built on first use, per save
        self._reuse_cache = _reuse_cache
        #: shard file name -> "direct" (O_DIRECT), "buffered" or "encoded" (stream transforms), for the last save
        self.write_paths: dict[str, str] = {}
        self.save_id = str(uuid.uuid4())
        self.rank: int | None = None
        self.use_collectives = True
        self.is_coordinator = False
        self._lock: Lock | None = None

    def __repr__(self) -> str:
        options = f", storage_options={self.storage_options!r}" if self.storage_options else ""
        return f"MmapWriter({self.path!r}{options})"

    # ------------------------------------------------------------------ DCP interface
    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self.release()  # a save of this writer that failed before its commit
        self._storage = None
        if checkpoint_id:
            self.path = os.fspath(checkpoint_id)
            self.storage
        self.save_id = str(uuid.uuid4())
        self.write_paths = {}
        self._reuse_index = None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self.rank = kwargs.get("rank")
        self.use_collectives = kwargs.get("use_collectives", True)

    @property
    def storage(self) -> CheckpointStorage:
        """Where this writer's checkpoint lives (storage/base.py)."""
        # one per checkpoint and load or save (reset() starts another): what it found of the files is kept
        if self._storage is None or self._storage[0] != self.path:
            storage = storage_for(self.path, error=CheckpointWriteError, options=self.storage_options)
            self._storage = (self.path, storage)
        return self._storage[1]

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        storage = self.storage
        per_rank = not self.use_collectives and self.rank is not None
        # the rank that commits holds the lock until it has
        self._lock = begin_save(storage, self.path, overwrite=self.options.overwrite,
                                lock=self.is_coordinator or per_rank, shared=per_rank)
        if per_rank:
            prefix = f"__{self.rank}_"
            avoid = frozenset(n for n in existing_shards(storage) if n.startswith(prefix))
            plan = dataclasses.replace(plan, storage_data=_Prefix(prefix, self.save_id, avoid))
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        # Runs on the coordinator before any rank writes a shard. The old commit stays in
        # place; new shards take names no file here has (commit.shard_name).
        if all(p.storage_data is not None for p in plans):
            return plans
        return _with_prefixes(plans, self.save_id, existing_shards(self.storage))

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        sd = plan.storage_data
        buckets = (_split_into_files(self.options.thread_count, plan.items) if self.single_file_per_rank
                   else [[it] for it in plan.items])  # the stock writer's single_file_per_rank=False
        files = [(shard_name(sd.prefix, i, sd.save_id, sd.avoid), bucket) for i, bucket in enumerate(buckets)]
        index = self._reusable()
        try:
            results = write_files(self.storage, files, planner, sd.save_id, self.options, self.write_paths, index)
        except BaseException:
            self.release()  # this save will not commit: a retry must not find the directory locked
            raise
        if self._reuse_cache is not None and index is not None:  # what the next save would read of these files
            self._reuse_cache.wrote(self.storage, sd.save_id, index.written)
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def _reusable(self) -> ReuseIndex | None:
        if self._reuse_index is None and self.options.transforms is None:
            self._reuse_index = save_index(self.storage, self.reuse, self._reuse_cache)
        return self._reuse_index

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        metadata.version = DCP_VERSION
        metadata.storage_data = {wr.index: wr.storage_data for wrs in results for wr in wrs}
        metadata.storage_meta = self.storage_meta()
        refs = references(metadata.storage_data, self._reusable)  # cross-step references' save ids, if any
        per_rank = not self.use_collectives and self.rank is not None
        storage = self.storage
        target = metadata_name(self.rank if per_rank else None)
        try:
            commit_save(storage, target, metadata, user_metadata=self.user_metadata, references=refs,
                        files={info.relative_path for info in metadata.storage_data.values()},
                        rank_prefix=f"__{self.rank}_" if per_rank else None, sync=self.options.sync_files)
        finally:
            self.release()

    def release(self) -> None:
        """Release the location's save lock if this writer holds it (a save that will not commit)."""
        lock, self._lock = self._lock, None
        if lock is not None:
            lock.release()

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.path, save_id=self.save_id)

    @property
    def checkpoint_id(self) -> str:
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        s = os.fspath(checkpoint_id)
        if is_url(s):
            try:
                storage_for(s, error=CheckpointWriteError)
            except CheckpointWriteError:
                return False
            return True
        return writable_local_path(s)

    @property
    def write_path(self) -> str | None:
        """How the last save wrote its shards: "direct", "buffered", "mixed", or None before one."""
        return how_written(self.write_paths)


