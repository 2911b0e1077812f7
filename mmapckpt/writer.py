"""MmapWriter: a DCP StorageWriter that writes raw, aligned tensor bytes.

It turns a DCP save plan into shard layouts (format.py) and positional writes
(_io.py), and records (file, offset, length) for every item in the storage data,
like the stock writer, so that any DCP planner works unchanged.
"""

from __future__ import annotations

import dataclasses
import glob
import io
import os
import uuid
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from . import format as fmt
from ._d2h import stage_to_host
from ._io import DirectWriter, atomic_write, fsync_dir, open_direct, pwrite_all
from .errors import CheckpointExistsError, CheckpointWriteError
from .metafile import METADATA_NAME, encode_metadata

__all__ = ["MmapWriter", "WriterOptions"]

DCP_VERSION = "1.0.0"
SHARD_SUFFIX = ".distcp"


@dataclass(frozen=True)
class WriterOptions:
    thread_count: int = 1
    sync_files: bool = True
    alignment: int = 4096
    overwrite: bool = True
    direct_io: bool = True

    def __post_init__(self) -> None:
        if self.thread_count < 1:
            raise ValueError(f"thread_count must be >= 1, got {self.thread_count}")
        fmt.layout_entries([], self.alignment)  # validates the alignment


@dataclass(frozen=True)
class _Prefix:
    prefix: str
    save_id: str | None = None  # the coordinator's save id, written into every shard header


def _chunk_nbytes(item: WriteItem) -> int:
    td = item.tensor_data
    assert td is not None  # a TENSOR/SHARD item always has tensor_data (DCP invariant, not file content)
    n = 1
    for s in td.chunk.sizes:
        n *= s
    return n * torch._utils._element_size(td.properties.dtype)


def _split_into_files(n: int, items: list[WriteItem]) -> list[list[WriteItem]]:
    """Spread items over ``n`` files of similar byte counts (greedy, largest first)."""
    if n == 1:
        return [list(items)] if items else []
    buckets: list[list[WriteItem]] = [[] for _ in range(n)]
    sizes = [0] * n
    byte_items = [i for i in items if i.type == WriteItemType.BYTE_IO]
    tensor_items = sorted((i for i in items if i.type != WriteItemType.BYTE_IO), key=_chunk_nbytes, reverse=True)
    for k, it in enumerate(byte_items):
        buckets[k % n].append(it)
    for it in tensor_items:
        k = sizes.index(min(sizes))
        buckets[k].append(it)
        sizes[k] += _chunk_nbytes(it)
    return [b for b in buckets if b]


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    """The tensor's own bytes in C order, from its memory where it is contiguous."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    t = t.resolve_conj().resolve_neg().contiguous().reshape(-1)
    if t.numel() == 1 and t.stride(0) != 1:  # one element counts as contiguous whatever its stride
        t = t.clone(memory_format=torch.contiguous_format)
    return memoryview(t.view(torch.uint8).numpy())


class MmapWriter(StorageWriter):
    """Writes a DCP checkpoint as raw, aligned tensor bytes behind a JSON header.

    Args:
        path: the checkpoint directory (created if missing).
        thread_count: files written in parallel per rank (one shard file each).
        sync_files: fsync every shard and the directory before the metadata commit.
        alignment: data offset alignment for entries at least this long (power of two >= 64).
        overwrite: allow replacing an existing checkpoint in ``path``.
        direct_io: write shards with O_DIRECT through page-aligned bounce buffers, bypassing
            the page cache (on a disk whose buffered write path is CPU-bound this saves two to
            three times faster; the saved files are then not in the page cache). Where the
            filesystem refuses O_DIRECT (tmpfs, some network filesystems) the shard is written
            buffered instead, automatically. ``write_paths`` records which path each shard took.

    Example:
        >>> import torch.distributed.checkpoint as dcp
        >>> dcp.save({"w": torch.ones(4)}, storage_writer=MmapWriter("/tmp/ckpt"), no_dist=True)
    """

    def __init__(self, path: str | os.PathLike[str], *, thread_count: int = 1, sync_files: bool = True,
                 alignment: int = 4096, overwrite: bool = True, direct_io: bool = True) -> None:
        super().__init__()
        self.path = os.fspath(path)
        self.options = WriterOptions(thread_count, sync_files, alignment, overwrite, direct_io)
        #: shard file name -> "direct" (O_DIRECT) or "buffered", for the last save
        self.write_paths: dict[str, str] = {}
        self.save_id = str(uuid.uuid4())
        self.rank: int | None = None
        self.use_collectives = True
        self.is_coordinator = False

    # ------------------------------------------------------------------ DCP interface
    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id:
            self.path = os.fspath(checkpoint_id)
        self.save_id = str(uuid.uuid4())
        self.write_paths = {}

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self.rank = kwargs.get("rank")
        self.use_collectives = kwargs.get("use_collectives", True)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        try:
            os.makedirs(self.path, exist_ok=True)
        except OSError as e:
            raise CheckpointWriteError(f"cannot create the checkpoint directory: {e}", path=self.path) from e
        meta = self._metadata_path(None if self.use_collectives else self.rank)
        if any(os.path.exists(m) for m in [meta, self._metadata_path(None)] + self._rank_commits()):
            if not self.options.overwrite:
                raise CheckpointExistsError("a checkpoint already exists here and overwrite=False", path=self.path)
            if not self.use_collectives:  # any commit here may name the shard files this rank rewrites
                self._invalidate(meta)
                self._invalidate(self._metadata_path(None))
        if self.rank is not None and not self.use_collectives:
            plan = dataclasses.replace(plan, storage_data=_Prefix(f"__{self.rank}_", self.save_id))
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        # Runs on the coordinator before any rank writes a shard: the old commit goes
        # first, so no metadata ever points at shards being rewritten.
        if self.use_collectives:
            for m in [self._metadata_path(None)] + self._rank_commits():
                self._invalidate(m)
        return [p if p.storage_data is not None else dataclasses.replace(p, storage_data=_Prefix(f"__{i}_", self.save_id))
                for i, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        prefix, save_id = plan.storage_data.prefix, plan.storage_data.save_id
        files = [(f"{prefix}{i}{SHARD_SUFFIX}", bucket)
                 for i, bucket in enumerate(_split_into_files(self.options.thread_count, plan.items))]
        if self.options.thread_count > 1 and len(files) > 1:
            with ThreadPoolExecutor(self.options.thread_count, thread_name_prefix="mmapckpt-write") as pool:
                per_file = list(pool.map(lambda f: self._write_file(f[0], f[1], planner, save_id), files))
        else:
            per_file = [self._write_file(name, bucket, planner, save_id) for name, bucket in files]
        if self.options.sync_files and files:
            try:
                fsync_dir(self.path)
            except OSError as e:
                raise CheckpointWriteError(f"syncing the checkpoint directory failed: {e}", path=self.path) from e
        fut: Future[list[WriteResult]] = Future()
        fut.set_result([r for rs in per_file for r in rs])
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        metadata.version = DCP_VERSION
        metadata.storage_data = {wr.index: wr.storage_data for wrs in results for wr in wrs}
        metadata.storage_meta = self.storage_meta()
        target = self._metadata_path(None if self.use_collectives else self.rank)
        try:
            data = encode_metadata(metadata)
        except (TypeError, ValueError) as e:
            raise CheckpointWriteError(f"cannot encode the checkpoint metadata: {e}", path=target) from e
        try:
            atomic_write(target, data, sync=self.options.sync_files)
        except OSError as e:
            raise CheckpointWriteError(f"committing the metadata failed: {e}", path=target) from e
        if self.use_collectives:
            self._remove_stale_shards({info.relative_path for info in metadata.storage_data.values()})

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.path, save_id=self.save_id)

    @property
    def checkpoint_id(self) -> str:
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        s = os.fspath(checkpoint_id)
        if "://" in s:
            return False
        p = os.path.abspath(s)
        while True:
            if os.path.isdir(p):
                return os.access(p, os.W_OK)
            parent = os.path.dirname(p)
            if parent == p:
                return False
            p = parent

    # ------------------------------------------------------------------ internals
    def _metadata_path(self, rank: int | None) -> str:
        name = METADATA_NAME if rank is None else f"__{rank}{METADATA_NAME}"
        return os.path.join(self.path, name)

    def _rank_commits(self) -> list[str]:
        """Per-rank metadata files (``__{rank}.metadata``) of a save made with use_collectives=False."""
        return glob.glob(os.path.join(glob.escape(self.path), f"__*{METADATA_NAME}"))

    def _invalidate(self, meta: str) -> None:
        try:
            os.unlink(meta)
            if self.options.sync_files:
                fsync_dir(self.path)
        except FileNotFoundError:
            return
        except OSError as e:
            raise CheckpointWriteError(f"cannot remove the previous checkpoint's metadata: {e}", path=meta) from e

    def _remove_stale_shards(self, referenced: set[str]) -> None:
        """Drop shard files of an overwritten checkpoint that the new one does not use,
        and temporary files left by earlier saves that were killed (this save's are renamed by now)."""
        d = glob.escape(self.path)
        leftovers = glob.glob(os.path.join(d, f".__*_*{SHARD_SUFFIX}.tmp-*")) + glob.glob(
            os.path.join(d, f".{METADATA_NAME}.tmp-*"))
        for p in glob.glob(os.path.join(d, f"__*_*{SHARD_SUFFIX}")) + leftovers:
            if os.path.basename(p) not in referenced:
                try:
                    os.unlink(p)
                except OSError:
                    pass

    def _write_file(self, name: str, items: list[WriteItem], planner: SavePlanner,
                    save_id: str | None) -> list[WriteResult]:
        """Lay out and write one shard under a temporary name, then rename it into place.

        A new inode replaces the old file, so readers that mapped the old one keep valid pages.
        """
        final = os.path.join(self.path, name)
        tmp = os.path.join(self.path, f".{name}.tmp-{uuid.uuid4().hex[:12]}")
        try:
            byte_payloads, specs = {}, []
            for it in items:  # BYTE_IO payloads are small: resolve them first to know every size
                if it.type == WriteItemType.BYTE_IO:
                    data = planner.resolve_data(it)
                    payload = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data)
                    byte_payloads[it.index] = payload
                    specs.append(fmt.EntrySpec(it.index.fqn, None, fmt.KIND_BYTES, None, (), len(payload)))
                else:
                    td = it.tensor_data
                    specs.append(fmt.EntrySpec(it.index.fqn, tuple(td.chunk.offsets), fmt.KIND_TENSOR,
                                               fmt.dtype_name(td.properties.dtype), tuple(td.chunk.sizes),
                                               _chunk_nbytes(it)))
            entries, file_size = fmt.layout_entries(specs, self.options.alignment, save_id)
            fd = open_direct(tmp) if self.options.direct_io else None
            self.write_paths[name] = "buffered" if fd is None else "direct"
            if fd is None:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                os.ftruncate(fd, file_size)
                if self.write_paths[name] == "direct":
                    done = self._write_entries_direct(fd, entries, items, byte_payloads, planner, save_id, file_size)
                else:
                    done = self._write_entries(fd, entries, items, byte_payloads, planner)
                    pwrite_all(fd, fmt.encode_header(done, save_id), 0)
                if self.options.sync_files:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, final)
        except OSError as e:
            _unlink_quietly(tmp)
            raise CheckpointWriteError(f"writing shard failed: {e}", path=final) from e
        except BaseException:
            _unlink_quietly(tmp)
            raise
        return [WriteResult(index=it.index, size_in_bytes=e.length, storage_data=_StorageInfo(name, e.offset, e.length))
                for e, it in zip(done, items)]

    def _write_entries(self, fd: int, entries: list[fmt.Entry], items: list[WriteItem],
                       byte_payloads: dict[Any, bytes], planner: SavePlanner) -> list[fmt.Entry]:
        """Write every entry's bytes at its offset; return the entries with their CRC-32s."""
        entry_of = {id(it): e for e, it in zip(entries, items)}
        done: dict[int, fmt.Entry] = {}
        for it in items:
            if it.type == WriteItemType.BYTE_IO:
                done[id(it)] = _write_at(fd, entry_of[id(it)], byte_payloads[it.index])
        tensor_items = [it for it in items if it.type != WriteItemType.BYTE_IO]
        for it, t in stage_to_host(tensor_items, planner.resolve_data):
            e = entry_of[id(it)]
            done[id(it)] = _write_at(fd, e, _planned_bytes(e, it, t))
        return [done[id(it)] for it in items]

    def _write_entries_direct(self, fd: int, entries: list[fmt.Entry], items: list[WriteItem],
                              byte_payloads: dict[Any, bytes], planner: SavePlanner, save_id: str | None,
                              file_size: int) -> list[fmt.Entry]:
        """_write_entries through a DirectWriter: entries in file order, then the header."""
        sink = DirectWriter(fd, min((e.offset for e in entries), default=file_size))
        # CRC-32s on a thread of their own (zlib releases the GIL): they overlap the copies into
        # the bounce buffers, which overlap the disk writes.
        crc_pool = ThreadPoolExecutor(1, thread_name_prefix="mmapckpt-crc")
        try:
            staged = stage_to_host([it for it in items if it.type != WriteItemType.BYTE_IO], planner.resolve_data)
            done, crcs = [], []
            for e, it in zip(entries, items):  # layout order is item order: ascending offsets
                if it.type == WriteItemType.BYTE_IO:
                    buf: Any = byte_payloads[it.index]
                else:
                    sit, t = next(staged)
                    assert sit is it  # stage_to_host yields in order (an invariant of ours, not file content)
                    buf = _planned_bytes(e, it, t)
                if len(buf) != e.length:
                    raise ValueError(f"{e.label}: {len(buf)} bytes resolved, {e.length} planned")
                # small entries inline: a hand-off to the thread costs more than their checksum
                crcs.append(crc_pool.submit(zlib.crc32, buf) if len(buf) >= _CRC_THREAD_MIN else _Done(zlib.crc32(buf)))
                sink.put(e.offset, buf)
                done.append(e)
            done = [dataclasses.replace(e, crc32=c.result()) for e, c in zip(done, crcs)]
            sink.finish(fmt.encode_header(done, save_id), file_size)
        finally:
            crc_pool.shutdown(wait=True)
            sink.close()
        return done

    @property
    def write_path(self) -> str | None:
        """How the last save wrote its shards: "direct", "buffered", "mixed", or None before one."""
        kinds = set(self.write_paths.values())
        return None if not kinds else kinds.pop() if len(kinds) == 1 else "mixed"


#: Entries at least this long get their CRC-32 computed on the checksum thread.
_CRC_THREAD_MIN = 1 << 20


class _Done:
    """A finished value with a Future's ``result()``."""

    __slots__ = ("value",)

    def __init__(self, value: int) -> None:
        self.value = value

    def result(self) -> int:
        return self.value


def _planned_bytes(e: fmt.Entry, it: WriteItem, t: torch.Tensor) -> Any:
    """The tensor's bytes, after checking it is what the plan laid out."""
    if tuple(t.shape) != e.shape or fmt.dtype_name(t.dtype) != e.dtype:
        raise ValueError(f"planner resolved {it.index.fqn!r} to {tuple(t.shape)} {t.dtype}, "
                         f"but the plan said {e.shape} {e.dtype}")
    return _tensor_bytes(t) if e.length else b""


def _write_at(fd: int, e: fmt.Entry, buf: Any) -> fmt.Entry:
    if len(buf) != e.length:
        raise ValueError(f"{e.label}: {len(buf)} bytes resolved, {e.length} planned")
    if e.length:
        pwrite_all(fd, buf, e.offset)
    return dataclasses.replace(e, crc32=zlib.crc32(buf))


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
