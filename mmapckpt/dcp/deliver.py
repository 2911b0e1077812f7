"""Read-once loading, the ``read_data`` side: read what this rank was assigned, then deliver it.

Every rank follows the same :class:`~mmapckpt.dcp.read_once.ReadOnceSchedule`, in order:

1. Local work, no collectives: resolve (and check) the targets of this rank's items of
   shared records, open and check (``verify=True``: checksum) the records this rank
   reads for the others, and read this rank's other items through the plain read path.
2. One ``all_gather_object`` of each rank's outcome. If any rank failed, every rank
   raises: the failed one its own typed error, the others a CheckpointError naming the
   rank, the file and what went wrong there. No rank is left waiting in a broadcast.
3. Each shared record travels from its reader in pieces of at most ``piece_bytes``:
   a broadcast where every rank of the group needs it, else sends to the ranks that do.
   A piece is a hypercube of the stored chunk that is one contiguous byte run (rows of
   the outermost dimension that fit, else a range along the first dimension whose step
   fits), so each rank copies just the part of it its items ask for (resharding); an
   item that takes a whole chunk into a contiguous target of its dtype on the transport's
   device receives the pieces straight into the target.

Errors in step 3 (a target a planner refuses at commit) are kept until every piece has
moved, then raised, so the collectives of the other ranks still complete.

What a reader rank sends (:class:`StoredRegions`) is a stored record's bytes as one flat uint8
tensor: an mmapckpt chunk is a view over the mapped shard (checked against the shard header as
the plain read path checks it, its CRC-32 verified first with ``verify=True``); a stock item is
read and loaded with ``weights_only=True`` and must have the dtype and shape the metadata gives
its chunk; a non-tensor value is its stored bytes. Pages of a mapped chunk are read from storage
when the bytes are sent, once; a chunk of a file without a mapping (an object) is fetched as it
is sent, a window of records at a time (dcp/record_fetch.py).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem

from ..errors import CheckpointError, FormatError, SizeMismatchError
from ..format.stock import load_tensor
from ..reading.dcp_safetensors import SafetensorsChunks
from ..reading.shard import Shard, check_size_unchanged
from ..storage.base import StoredFile
from .read_once import ReadOnceOptions, ReadOnceSchedule, SharedRecord
from .record_fetch import RecordFetcher, RemoteRecord
from .read_paths import FileReads, load_bytes, label, read_plan
from .safetensors_metadata import KIND_SAFETENSORS
from .safetensors_reads import chunk_bytes, safetensors_in

__all__ = ["StoredRegions", "load_plan", "pieces", "read_once_load"]

Piece = tuple[int, int, tuple[int, ...], tuple[int, ...]]  # byte offset, byte length, starts, lengths


def pieces(sizes: tuple[int, ...], itemsize: int, piece_bytes: int) -> Iterator[Piece]:
    """The pieces of a row-major chunk of ``sizes``: hypercubes, each a contiguous run of at most
    ``piece_bytes`` bytes (or one element, where an element is bigger)."""
    n = len(sizes)
    if n == 0:
        yield 0, itemsize, (), ()
        return
    if 0 in sizes:
        return
    inner = [itemsize] * n  # bytes of one step along each dimension
    for d in range(n - 2, -1, -1):
        inner[d] = inner[d + 1] * sizes[d + 1]
    d = next((j for j in range(n) if inner[j] <= piece_bytes), n - 1)
    k = max(1, piece_bytes // inner[d])
    for outer in itertools.product(*(range(s) for s in sizes[:d])):
        base = sum(i * inner[j] for j, i in enumerate(outer))
        for s in range(0, sizes[d], k):
            e = min(sizes[d], s + k)
            yield (base + s * inner[d], (e - s) * inner[d], outer + (s,) + (0,) * (n - d - 1),
                   (1,) * d + (e - s,) + tuple(sizes[d + 1:]))


class StoredRegions:
    """The stored bytes of records, for one load; keeps the shards it mapped open until :meth:`close`."""

    def __init__(self, reads: FileReads) -> None:
        self.reads = reads
        #: file name -> (the file, its mmapckpt shard or None for a stock file)
        self._files: dict[str, tuple[StoredFile, Shard | None]] = {}
        #: file name -> the safetensors data its tensors are in (None: torch.save items)
        self._st: dict[str, SafetensorsChunks | None] = {}

    def path_of(self, idx: MetadataIndex) -> str:
        return self.reads.storage.full(self.reads.info(idx).relative_path)

    def source(self, idx: MetadataIndex, is_bytes: bool) -> torch.Tensor | RemoteRecord:
        """The record's bytes (a non-tensor value's, or the chunk's raw bytes in row-major order); a chunk of
        an unmapped file, not verified, as a :class:`RemoteRecord` fetched when it is sent."""
        reads, info = self.reads, self.reads.info(idx)
        f, shard = self._open(info.relative_path, idx)
        path = f.path
        st = None if shard is not None or is_bytes else self._safetensors(info.relative_path, f, idx, info)
        if st is not None:  # a Hugging Face file, or a SAFETENSORS-format stock shard (dcp/safetensors_reads.py)
            return chunk_bytes(reads, st, idx, info, reads.metadata_kind == KIND_SAFETENSORS)
        reads.counter.take(path, info.offset, info.length)  # sent whole (mapped pages read as they go)
        if shard is not None:
            if reads.verify:
                shard.verify(shard.entry(idx.fqn, None if is_bytes else tuple(idx.offset or ())))
            if is_bytes:
                return torch.frombuffer(bytearray(shard.object_bytes(idx.fqn, info.offset, info.length)),
                                        dtype=torch.uint8) if info.length else torch.empty(0, dtype=torch.uint8)
            dtype, sizes = reads.chunk_layout(idx, path)
            view = shard.view((idx.fqn, tuple(idx.offset)), info.offset, info.length, dtype, sizes,
                              lazy=not reads.verify)  # checked against the header either way
            if view.is_meta:
                return RemoteRecord(shard.stored, info.offset, info.length, label(idx))
            return view.reshape(-1).view(torch.uint8)
        buf = f.read(info.offset, info.length, entry=label(idx))
        if is_bytes:
            return torch.frombuffer(buf, dtype=torch.uint8) if len(buf) else torch.empty(0, dtype=torch.uint8)
        dtype, sizes = reads.chunk_layout(idx, path)
        t = load_tensor(buf, path=path, entry=label(idx))
        if t.dtype != dtype:
            raise FormatError(f"stored item is {t.dtype}, the metadata says {dtype}", path=path, entry=label(idx))
        if tuple(t.shape) != tuple(sizes):
            raise SizeMismatchError(f"stored item has shape {list(t.shape)}, the metadata says {list(sizes)}",
                                    path=path, entry=label(idx))
        return t.contiguous().reshape(-1).view(torch.uint8)

    def _open(self, rel: str, idx: MetadataIndex) -> tuple[StoredFile, Shard | None]:
        if rel not in self._files:
            f = self.reads.open_file(rel, label(idx))
            try:
                self._files[rel] = (f, self.reads.open_shard(f, rel))
            except BaseException:
                f.close()
                raise
        return self._files[rel]

    def _safetensors(self, rel: str, f: StoredFile, idx: MetadataIndex, info: Any) -> SafetensorsChunks | None:
        if rel not in self._st:
            self._st[rel] = safetensors_in(self.reads, f, (idx, info), self.reads.metadata_kind == KIND_SAFETENSORS)
        return self._st[rel]

    def close(self) -> None:
        """Check that no mapped shard shrank while its bytes were sent, then release the files."""
        files, self._files = self._files, {}
        try:
            for f, shard in files.values():
                if shard is not None:
                    check_size_unchanged(shard)
                else:
                    f.check_unchanged()
        finally:
            for f, _ in files.values():
                f.close()


class _Wanted:
    """This rank's items of one shared record, their targets resolved and checked."""

    def __init__(self, reads: FileReads, planner: LoadPlanner, rec: SharedRecord, items: list[ReadItem],
                 shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, me: int) -> None:
        self.items, self.path = items, reads.info(rec.index).relative_path
        self.targets: list[torch.Tensor] = []
        for req in items:
            if req.type == LoadItemType.BYTE_IO:
                self.targets.append(torch.empty(reads.info(rec.index).length, dtype=torch.uint8))
                continue
            if any(o + n > s for o, n, s in zip(req.storage_offsets, req.lengths, shape)) or \
                    len(req.lengths) != len(shape):
                raise SizeMismatchError(f"requested region {list(req.storage_offsets)}+{list(req.lengths)} is "
                                        f"outside the stored chunk {list(shape)}", path=self.path,
                                        entry=label(req.storage_index))
            t = planner.resolve_tensor(req).detach()
            if tuple(t.size()) != tuple(req.lengths):
                raise SizeMismatchError(f"stored region has shape {list(req.lengths)} but the target has "
                                        f"{list(t.size())}", path=self.path, entry=label(req.storage_index))
            self.targets.append(t)
        self.direct: torch.Tensor | None = None  # the flat bytes the pieces are received into
        if len(items) == 1 and me != rec.reader:
            req, t = items[0], self.targets[0]
            whole = req.type == LoadItemType.BYTE_IO or (not any(req.storage_offsets)
                                                         and tuple(req.lengths) == tuple(shape) and t.dtype == dtype)
            if whole and t.numel() and t.is_contiguous() and t.device == device and not t.is_conj() \
                    and not t.is_neg():
                self.direct = t.reshape(-1).view(torch.uint8)

    def take(self, piece: torch.Tensor, p: Piece, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        """Copy the parts of one piece (its bytes, on any device) that this rank's items ask for."""
        off, n, starts, lengths = p
        for req, t in zip(self.items, self.targets):
            if req.type == LoadItemType.BYTE_IO:
                t[off:off + n].copy_(piece)
                continue
            src = piece.view(dtype).reshape(lengths)
            dst = t
            for j, (a, m, o, q) in enumerate(zip(starts, lengths, req.storage_offsets, req.lengths)):
                lo, hi = max(a, o), min(a + m, o + q)
                if hi <= lo:
                    break
                src, dst = src.narrow(j, lo - a, hi - lo), dst.narrow(j, lo - o, hi - lo)
            else:
                dst.copy_(src)

    def commit(self, planner: LoadPlanner) -> None:
        for req, t in zip(self.items, self.targets):
            if req.type == LoadItemType.BYTE_IO:
                load_bytes(planner, req, t.numpy().tobytes(), self.path)
            else:
                planner.commit_tensor(req, t)


def _agree(error: BaseException | None, group: Any) -> None:
    """Every rank's outcome of the local step; raise on every rank if any failed."""
    mine = None if error is None else (type(error).__name__, str(error), getattr(error, "path", None),
                                       getattr(error, "entry", None))
    got: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(got, mine, group=group)
    failed = [(r, f) for r, f in enumerate(got) if f is not None]
    if not failed:
        return
    if error is not None:
        raise error
    r, (kind, msg, path, entry) = failed[0]
    raise CheckpointError(f"rank {r} could not read its part of this read-once load, so no rank loads it: "
                          f"{kind}: {msg}", path=path, entry=entry)


def load_plan(plan: LoadPlan, planner: LoadPlanner, reads: FileReads, options: ReadOnceOptions,
              thread_count: int) -> None:
    """MmapReader.read_data's work: under the read-once schedule the plan carries, else the plain way."""
    if isinstance(plan.storage_data, ReadOnceSchedule):
        read_once_load(plan, planner, plan.storage_data, reads, options.group, options.piece_bytes,
                       lambda p: read_plan(reads, p, planner, thread_count))
    else:
        read_plan(reads, plan, planner, thread_count)


def read_once_load(plan: LoadPlan, planner: LoadPlanner, schedule: ReadOnceSchedule, reads: FileReads, group: Any,
                   piece_bytes: int, read_plain: Callable[[LoadPlan], None]) -> None:
    """Load ``plan`` under ``schedule``: the steps of this module's docstring."""
    world, me = dist.get_world_size(group), dist.get_rank(group)
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(world))
    on_cuda = "nccl" in str(dist.get_backend(group)).lower()
    device = torch.device("cuda", torch.cuda.current_device()) if on_cuda else torch.device("cpu")
    shared = {rec.index: rec for rec in schedule.records}
    mine: dict[Any, list[ReadItem]] = {}
    plain = []
    for req in plan.items:
        (mine.setdefault(req.storage_index, []) if req.storage_index in shared else plain).append(req)
    regions = StoredRegions(reads)
    error: BaseException | None = None
    layouts: dict[Any, tuple[tuple[int, ...], torch.dtype]] = {}
    wanted: dict[Any, _Wanted] = {}
    sources: dict[Any, torch.Tensor | RemoteRecord] = {}
    try:
        if schedule.world != world:
            raise CheckpointError(f"the read-once schedule was made for {schedule.world} ranks, but the "
                                  f"reader's group has {world}: pass dcp.load's process group as read_once_group",
                                  path=reads.root)
        for rec in schedule.records:
            idx = rec.index
            if idx.offset is None:  # a non-tensor value: its stored bytes
                layouts[idx] = ((reads.info(idx).length,), torch.uint8)
            else:
                dtype, sizes = reads.chunk_layout(idx, regions.path_of(idx))
                layouts[idx] = (tuple(sizes), dtype)
            if idx in mine:
                wanted[idx] = _Wanted(reads, planner, rec, mine[idx], *layouts[idx], device, me)
            if rec.reader == me:
                sources[idx] = regions.source(idx, idx.offset is None)
        read_plain(LoadPlan(plain))
    except Exception as e:  # noqa: BLE001 - every rank must hear of it before any data moves
        error = e
    try:
        _agree(error, group)
        fetcher = RecordFetcher([(r.index, sources[r.index]) for r in schedule.records  # type: ignore[misc]
                                 if isinstance(sources.get(r.index), RemoteRecord)], piece_bytes)
        late = _send_all(schedule, sources, wanted, layouts, planner, group, ranks, me, device, piece_bytes, fetcher)
    finally:
        regions.close()
    if late is not None:
        raise late


def _send_all(schedule: ReadOnceSchedule, sources: dict[Any, torch.Tensor | RemoteRecord],
              wanted: dict[Any, _Wanted], layouts: dict[Any, Any], planner: LoadPlanner, group: Any,
              ranks: list[int], me: int, device: torch.device, piece_bytes: int,
              fetcher: RecordFetcher) -> BaseException | None:
    """Move every shared record, piece by piece; the first error of this rank's copies, if any."""
    late: BaseException | None = None
    buf: torch.Tensor | None = None
    # One piece at most: piece_bytes, or one element where an element is bigger, or the biggest record.
    biggest = max((layouts[r.index][1].itemsize * _numel(layouts[r.index][0]) for r in schedule.records), default=0)
    buf_bytes = max(min(piece_bytes, biggest), 16)
    for rec in schedule.records:
        everyone = len(rec.ranks) == schedule.world
        if not everyone and me not in rec.ranks:
            continue
        shape, dtype = layouts[rec.index]
        want = wanted.get(rec.index)
        for p in pieces(shape, dtype.itemsize, piece_bytes):
            off, n = p[0], p[1]
            if me == rec.reader:
                src = sources[rec.index]
                if isinstance(src, RemoteRecord):  # fetched now, into the buffer it is sent from on the CPU
                    if device.type == "cpu" and buf is None:
                        buf = torch.empty(buf_bytes, dtype=torch.uint8)
                    piece = fetcher.piece(rec.index, off, n, buf if device.type == "cpu" else None)
                else:
                    piece = src[off:off + n]
                if device.type != "cpu":
                    buf = buf if buf is not None else torch.empty(buf_bytes, dtype=torch.uint8, device=device)
                    piece = buf[:n].copy_(piece)
            elif want is not None and want.direct is not None:
                piece = want.direct[off:off + n]
            else:
                buf = buf if buf is not None else torch.empty(buf_bytes, dtype=torch.uint8, device=device)
                piece = buf[:n]
            _move(piece, rec, me, group, ranks, everyone)
            if want is not None and late is None and (me == rec.reader or want.direct is None):
                try:
                    want.take(piece, p, shape, dtype)
                except Exception as e:  # noqa: BLE001 - raised once every piece has moved
                    late = e
        if want is not None and late is None:
            try:
                want.commit(planner)
            except Exception as e:  # noqa: BLE001
                late = e
    return late


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _move(piece: torch.Tensor, rec: SharedRecord, me: int, group: Any, ranks: list[int], everyone: bool) -> None:
    """Send ``piece`` from the record's reader to the ranks that need it (all of the group: a broadcast)."""
    src = ranks[rec.reader]
    if everyone:
        dist.broadcast(piece, src=src, group=group)
    elif me == rec.reader:
        for work in [dist.isend(piece, dst=ranks[r], group=group) for r in rec.ranks if r != me]:
            work.wait()
    else:
        dist.recv(piece, src=src, group=group)
