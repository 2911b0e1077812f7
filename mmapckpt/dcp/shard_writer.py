"""Writing one shard file: lay out the entries, write their bytes, then the header, then rename it in.

The writer (writer.py) decides which items go to which file and commits the metadata;
this module turns one file's items into bytes on disk, through O_DIRECT bounce buffers
where the filesystem takes them and positional writes where it does not.
"""

from __future__ import annotations

import functools
import io
import math
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.planner import SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from ..errors import CheckpointError, CheckpointWriteError
from ..format import layout as fmt
from ..format.aliases import item_aliases
from ..io.d2h import stage_to_host
from ..format.transforms import StreamTransforms
from ..storage.base import CheckpointStorage, FileOutput
from .encoded_shard import write_encoded_entries
from .plan_items import write_result
from .storable import CHECKED_ATTR, check_storable

__all__ = ["WriterOptions", "write_files", "write_shard", "chunk_nbytes"]


@dataclass(frozen=True)
class WriterOptions:
    thread_count: int = 1
    sync_files: bool = True
    alignment: int = 4096
    overwrite: bool = True
    direct_io: bool = True
    #: DCP stream transforms every item is written through (``_extensions``); none: raw, mappable entries
    transforms: StreamTransforms | None = None

    def __post_init__(self) -> None:
        if self.thread_count < 1:
            raise ValueError(f"thread_count must be >= 1, got {self.thread_count}")
        fmt.layout_entries([], self.alignment)  # validates the alignment


def chunk_nbytes(item: WriteItem) -> int:
    td = item.tensor_data
    assert td is not None  # a TENSOR/SHARD item always has tensor_data (DCP invariant, not file content)
    n = 1
    for s in td.chunk.sizes:
        n *= s
    return n * torch._utils._element_size(td.properties.dtype)


#: dtype -> the dtype numpy views its tensors' bytes as: itself (None), or an integer of its width for
#: the dtypes numpy lacks (a CPU tensor's bytes without torch's view chain)
_NUMPY_VIEW: dict[torch.dtype, torch.dtype | None] = {
    **dict.fromkeys((torch.float64, torch.float32, torch.float16, torch.int64, torch.int32, torch.int16, torch.int8,
                     torch.uint8, torch.bool, torch.complex64, torch.complex128)),
    torch.bfloat16: torch.int16, torch.uint16: torch.int16, torch.uint32: torch.int32, torch.uint64: torch.int64,
    **dict.fromkeys((getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
                     if hasattr(torch, n)), torch.uint8),
}


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    """The tensor's own bytes in C order, from its memory where it is contiguous."""
    view_as = _NUMPY_VIEW.get(t.dtype, t)  # t: not viewable
    if (view_as is not t and t.is_cpu and t.is_contiguous() and t.numel() > 1 and not t.requires_grad
            and not t.is_conj() and not t.is_neg()):
        # the common case, at a third of the steps below
        return memoryview((t if view_as is None else t.view(view_as)).numpy()).cast("B")
    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    t = t.resolve_conj().resolve_neg().contiguous().reshape(-1)
    if t.numel() == 1 and t.stride(0) != 1:  # one element counts as contiguous whatever its stride
        t = t.clone(memory_format=torch.contiguous_format)
    return memoryview(t.view(torch.uint8).numpy())


def write_files(storage: CheckpointStorage, files: list[tuple[str, list[WriteItem]]], planner: SavePlanner,
                save_id: str, options: WriterOptions, write_paths: dict[str, str]) -> list[WriteResult]:
    """Write one rank's shard files (``thread_count`` at a time), then fsync the directory.

    ``write_paths`` receives each finished file's write path. If any file fails, the files
    this call finished are removed again (no commit will name them) and the error is raised.
    """
    if not getattr(planner, CHECKED_ATTR, False):
        planner = _Checked(planner, storage.location)  # type: ignore[assignment]
    try:
        if options.thread_count > 1 and len(files) > 1:
            with ThreadPoolExecutor(options.thread_count, thread_name_prefix="mmapckpt-write") as pool:
                per_file = list(pool.map(lambda f: _write_one(storage, f, planner, save_id, options, write_paths),
                                         files))
        else:
            per_file = [_write_one(storage, f, planner, save_id, options, write_paths) for f in files]
        if options.sync_files and files:
            storage.sync()
    except BaseException:
        storage.remove(list(write_paths), sync=False)  # every file of this save (the pool has joined its threads)
        raise
    return [r for rs in per_file for r in rs]


class _Checked:
    """``planner``, whose ``resolve_data`` refuses a tensor no checkpoint can hold (storable.py), naming it."""

    def __init__(self, planner: SavePlanner, directory: str) -> None:
        self._planner, self._directory = planner, directory

    def resolve_data(self, item: WriteItem) -> Any:
        data = self._planner.resolve_data(item)
        if isinstance(data, torch.Tensor):
            check_storable(item.index.fqn, data, self._directory)
        return data

    def __getattr__(self, name: str) -> Any:  # the rest (tied-weight records, ...) is the planner's
        return getattr(self._planner, name)


def _dtype_name(it: WriteItem, dtype: torch.dtype, directory: str) -> str:
    try:
        return fmt.dtype_name(dtype)
    except ValueError:
        raise CheckpointWriteError(f"cannot save this tensor: it has dtype {dtype}, which the mmapckpt format "
                                   "cannot store (docs/format.md, section 2.4)", path=directory,
                                   entry=it.index.fqn) from None


def _write_one(storage: CheckpointStorage, f: tuple[str, list[WriteItem]], planner: SavePlanner, save_id: str,
               options: WriterOptions, write_paths: dict[str, str]) -> list[WriteResult]:
    results, write_paths[f[0]] = write_shard(storage, f[0], f[1], planner, save_id, options)
    return results


def write_shard(storage: CheckpointStorage, name: str, items: list[WriteItem], planner: SavePlanner,
                save_id: str | None, options: WriterOptions) -> tuple[list[WriteResult], str]:
    """Lay out and write one shard (storage/base.py ``create_file``: it appears under ``name`` once durable).

    Locally a new inode replaces the old file, so readers that mapped the old one keep valid pages.
    """
    out = None
    directory = storage.location
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
                sizes, dtype = td.chunk.sizes, td.properties.dtype
                specs.append(fmt.EntrySpec(it.index.fqn, tuple(td.chunk.offsets), fmt.KIND_TENSOR,
                                           _dtype_name(it, dtype, directory), tuple(sizes),
                                           math.prod(sizes) * dtype.itemsize))
        if options.transforms is not None:
            out = storage.create_file(name, None, head=0, direct=False, sync=options.sync_files)
            done = write_encoded_entries(out, items, byte_payloads, planner, options.transforms, save_id,
                                         lambda it, t: _planned_bytes(_spec_entry(it), it, t))
            return _results(name, done, items), "encoded"
        alias_of = item_aliases([it.index for it in items], planner)  # tied weights: their bytes once
        plan = fmt.plan_shard(specs, options.alignment, save_id, alias_of)
        own = [i for i in range(len(items)) if i not in alias_of] if alias_of else range(len(items))
        every_crc = functools.partial(_with_aliases, own=own, alias_of=alias_of)
        entries = [plan.entries[i] for i in own]
        out = storage.create_file(name, plan.file_size, head=min((e.offset for e in entries), default=plan.file_size),
                                  direct=options.direct_io, sync=options.sync_files)
        _write_entries(out, entries, [items[i] for i in own], byte_payloads, planner, plan, every_crc)
    except BaseException as e:
        if out is not None:
            out.abort()
        typed = _shard_error(e, storage.full(name))
        if typed is e:
            raise
        raise typed from e
    return _results(name, plan.entries, items), out.how


def _shard_error(e: BaseException, final: str) -> BaseException:
    """``e`` as a failed shard write reports it: a CheckpointWriteError naming the shard for an OSError or for
    torch refusing a tensor's bytes; a CheckpointError (it names its entry) and anything else as it is."""
    if isinstance(e, CheckpointError) or not isinstance(e, (OSError, RuntimeError, NotImplementedError, TypeError,
                                                             ValueError)):
        return e
    what = str(e) if isinstance(e, OSError) else f"{type(e).__name__}: {e}"
    return CheckpointWriteError(f"writing shard failed: {what}", path=final)


def _with_aliases(crcs: list[int], own: Any, alias_of: dict[int, int]) -> list[int]:
    """Every entry's CRC-32, in item order, from the written ones': an alias has its canonical entry's."""
    if not alias_of:
        return crcs
    full = [0] * (len(own) + len(alias_of))
    for i, c in zip(own, crcs):
        full[i] = c
    for i, j in alias_of.items():  # j is written, never itself an alias (aliases.item_aliases)
        full[i] = full[j]
    return full


def _results(name: str, done: list[fmt.Entry], items: list[WriteItem]) -> list[WriteResult]:
    return [write_result(it.index, e.length, _StorageInfo(
        name, e.offset, e.length, list(e.transforms) if e.transforms else None)) for e, it in zip(done, items)]


def _spec_entry(it: WriteItem) -> fmt.Entry:
    """The planned shape and dtype of a tensor item, as an entry (for _planned_bytes' check)."""
    td = it.tensor_data
    return fmt.Entry(it.index.fqn, tuple(td.chunk.offsets), fmt.KIND_TENSOR, fmt.dtype_name(td.properties.dtype),
                     tuple(td.chunk.sizes), 0, chunk_nbytes(it), 0)

def _write_entries(sink: FileOutput, entries: list[fmt.Entry], items: list[WriteItem],
                   byte_payloads: dict[Any, bytes], planner: SavePlanner, plan: fmt.ShardPlan,
                   every_crc: Any) -> None:
    """Every entry's bytes in file order, then the header (with ``every_crc``'s CRC-32s), finishing the file."""
    # CRC-32s on a thread of their own (zlib releases the GIL): they overlap the copies into
    # the bounce buffers, which overlap the disk writes.
    crc_pool = ThreadPoolExecutor(1, thread_name_prefix="mmapckpt-crc")
    try:
        staged = stage_to_host([it for it in items if it.type != WriteItemType.BYTE_IO], planner.resolve_data)
        crcs: list[Any] = []
        big = False
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
            if len(buf) >= _CRC_THREAD_MIN:
                crcs.append(crc_pool.submit(zlib.crc32, buf))
                big = True
            else:
                crcs.append(zlib.crc32(buf))
            sink.put(e.offset, buf)
        if big:
            crcs = [c if type(c) is int else c.result() for c in crcs]
        sink.finish(plan.header(every_crc(crcs)))
    finally:
        crc_pool.shutdown(wait=True)


#: Entries at least this long get their CRC-32 computed on the checksum thread.
_CRC_THREAD_MIN = 1 << 20


def _planned_bytes(e: fmt.Entry, it: WriteItem, t: torch.Tensor) -> Any:
    """The tensor's bytes, after checking it is what the plan laid out."""
    if t.shape != e.shape or fmt.dtype_name(t.dtype) != e.dtype:
        raise ValueError(f"planner resolved {it.index.fqn!r} to {tuple(t.shape)} {t.dtype}, "
                         f"but the plan said {e.shape} {e.dtype}")
    return _tensor_bytes(t) if e.length else b""
