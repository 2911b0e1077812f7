"""The one shard writer: entries in, one shard file out, through a storage's ``FileOutput``.

Every shard file mmapckpt writes comes from :func:`write_shard`: the DCP writer's
(dcp/shard_writer.py, for ``dcp.save`` and ``mmapckpt.save``) and the conversion's
(conversion/sinks.py, ``convert(..., to="mmapckpt")``). Given the entries of one file it

1. lays them out (``format/layout.py`` ``plan_shard``: each entry at an aligned offset after a
   header reserved at its final width; tied weights' aliases share their canonical entry's bytes);
2. resolves each tensor lazily and in file order (accelerator tensors come to the host through
   ``io/d2h.py`` ``stage_to_host``, their copies running ahead within a bounded budget), checks
   it is the tensor laid out, and hands its bytes to ``FileOutput.put`` at ascending offsets,
   with CRC-32s computed alongside (format/crc.py; on a helper thread for large entries: it releases the GIL,
   so they overlap the copies into the O_DIRECT bounce buffers, which overlap the disk writes);
3. finishes the file with the header, which holds the CRC-32s (``FileOutput.finish``: written
   at offset 0 last, the file made durable and put in place under its name).

Entries written through DCP stream transforms take writing/encoded.py's path instead: the
header space is reserved, each entry encoded behind it, the header written last.

Any failure aborts the file (nothing is left under its name or a temporary one) and is raised
typed: a CheckpointError as it is (it names its file and entry), an OSError or torch refusing a
tensor's bytes as a CheckpointWriteError naming the shard and the entry being written.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from ..errors import CheckpointError, CheckpointWriteError
from ..format.crc import crc32
from ..format import layout as fmt
from ..format.transforms import StreamTransforms
from ..records import Record
from ..storage.base import CheckpointStorage, FileOutput
from .dedup import ReuseIndex, write_deduplicated
from .encoded import write_encoded_entries
from .tensors import entry_bytes

__all__ = ["ShardEntry", "ShardOptions", "write_shard", "shard_error"]


class ShardEntry(Record):
    """One entry to write. Its first six fields are ``format/layout.py`` ``EntrySpec``'s (the shard is laid
    out from the entries as they are).

    ``kind`` is ``KIND_TENSOR`` (``dtype``: the format's dtype name; ``length``: the chunk's bytes; ``data``:
    what the writer's ``resolve`` turns into the tensor, when its turn comes) or ``KIND_BYTES``
    (``chunk_offsets`` None, ``dtype`` None, ``shape`` (); ``data``: the payload's bytes).
    """

    __slots__ = ()

    fqn: str
    chunk_offsets: tuple[int, ...] | None
    kind: str
    dtype: str | None
    shape: tuple[int, ...]
    length: int
    data: Any

    def __new__(cls, fqn: str, chunk_offsets: tuple[int, ...] | None, kind: str, dtype: str | None,
                shape: tuple[int, ...], length: int, data: Any) -> ShardEntry:
        return tuple.__new__(cls, (fqn, chunk_offsets, kind, dtype, shape, length, data))

    @property
    def label(self) -> str:
        return self.fqn if self.chunk_offsets is None else f"{self.fqn}@{list(self.chunk_offsets)}"


@dataclass(frozen=True)
class ShardOptions:
    """How a shard is written.

    Attributes:
        alignment: entries at least this long start on a multiple of it (a power of two >= 64; docs/format.md 2.3).
        direct: bypass the page cache (O_DIRECT) where the storage can.
        sync: make the file durable before it is put in place.
        transforms: DCP stream transforms every entry is encoded through; None: raw, mappable entries.
    """

    alignment: int = 4096
    direct: bool = True
    sync: bool = True
    transforms: StreamTransforms | None = None

    def __post_init__(self) -> None:
        fmt.plan_shard([], self.alignment)  # ValueError for an alignment the format does not allow


class _At:
    """The position of the entry being written (None: none), for the error that names it."""

    index: int | None = None


def write_shard(storage: CheckpointStorage, name: str, entries: Sequence[ShardEntry],
                resolve: Callable[[Any], Any], *, save_id: str | None, options: ShardOptions,
                aliases: Mapping[int, int] | None = None, advance: Callable[[int], None] | None = None,
                one_at_a_time: bool = False, reuse: ReuseIndex | None = None) -> tuple[list[fmt.Entry], str]:
    """Write ``entries`` as shard ``name`` of ``storage``; return the written entries (offset, length, CRC-32),
    in input order, and how the bytes travelled (``FileOutput.how``, or ``"encoded"``).

    Args:
        resolve: a tensor entry's ``data`` -> the tensor (any device), called once per entry, in order.
        aliases: ``{i: j}``, ``j < i``: entry ``i`` is an exact alias of entry ``j`` (tied weights,
            format/aliases.py), which is not itself an alias: its bytes are written once, and ``i`` gets
            ``j``'s record. With ``options.transforms`` every entry is encoded on its own (none is an alias).
        advance: called with a tensor entry's length once its bytes are written (an alias's with its
            canonical entry's), for progress reports.
        one_at_a_time: ``resolve`` gives new memory for each tensor (a conversion reading its source): each
            one's checksum is awaited once it is written, and it is let go before the next is resolved, so
            at most one is held. Otherwise (a state dict's tensors, which live on anyway) checksums may lag
            behind the writes.
        reuse: hash every tensor chunk and refer to the equal chunks this index holds instead of writing them
            (writing/dedup.py): those come back as ``Reference`` records, and how the bytes travelled is
            ``"referenced"`` when no entry was written (no file then). Raw entries only (no transforms).
    """
    out: FileOutput | None = None
    at = _At()
    try:
        if options.transforms is not None:
            out = storage.create_file(name, None, head=0, direct=False, sync=options.sync)
            return write_encoded_entries(out, entries, resolve, options.transforms, save_id, at), "encoded"
        if reuse is not None:
            return write_deduplicated(storage, name, entries, resolve, save_id=save_id,  # type: ignore[return-value]
                                      alignment=options.alignment, direct=options.direct, sync=options.sync,
                                      aliases=aliases, index=reuse, at=at)
        plan = fmt.plan_shard(entries, options.alignment, save_id, aliases)
        own = [i for i in range(len(entries)) if i not in aliases] if aliases else range(len(entries))
        first = min((plan.entries[i].offset for i in own), default=plan.file_size)
        out = storage.create_file(name, plan.file_size, head=first, direct=options.direct, sync=options.sync)
        crcs = _write_entries(out, plan, entries, own, resolve, aliases or {}, advance, one_at_a_time, at)
    except BaseException as e:
        if out is not None:
            out.abort()
        typed = shard_error(e, storage.full(name), None if at.index is None else entries[at.index].label)
        if typed is e:
            raise
        raise typed from e
    new = tuple.__new__
    return [new(fmt.Entry, (*e[:7], c, e[8])) for e, c in zip(plan.entries, crcs)], out.how


def shard_error(e: BaseException, final: str, entry: str | None = None) -> BaseException:
    """``e`` as a failed shard write reports it: a CheckpointWriteError naming the shard (and the entry being
    written, if any) for an OSError or for torch refusing a tensor's bytes; a CheckpointError (it names its
    entry) and anything else as it is."""
    if isinstance(e, CheckpointError) or not isinstance(e, (OSError, RuntimeError, NotImplementedError, TypeError,
                                                             ValueError)):
        return e
    what = str(e) if isinstance(e, OSError) else f"{type(e).__name__}: {e}"
    return CheckpointWriteError(f"writing shard failed: {what}", path=final, entry=entry)


#: Entries at least this long get their CRC-32 computed on the checksum thread.
_CRC_THREAD_MIN = 1 << 20


def _write_entries(out: FileOutput, plan: fmt.ShardPlan, entries: Sequence[ShardEntry], own: Sequence[int],
                   resolve: Callable[[Any], Any], aliases: Mapping[int, int],
                   advance: Callable[[int], None] | None, one_at_a_time: bool, at: _At) -> list[int]:
    """The bytes of the entries ``own`` (not aliases) in file order, then the header; every entry's CRC-32."""
    extra = {}  # canonical entry -> its aliases' lengths, reported with it
    if advance is not None:
        for i, j in aliases.items():
            extra[j] = extra.get(j, 0) + entries[i].length
    # CRC-32s on a thread of their own (format/crc.py releases the GIL): they overlap the copies into
    # the bounce buffers, which overlap the disk writes.
    crc_pool = ThreadPoolExecutor(1, thread_name_prefix="mmapckpt-crc")
    try:
        crcs: list[Any] = []
        big = False
        for i, buf in entry_bytes(entries, own, resolve, at):  # layout order is input order: ascending offsets
            e, offset = entries[i], plan.entries[i].offset
            if len(buf) != e.length:
                raise ValueError(f"{e.label}: {len(buf)} bytes resolved, {e.length} planned")
            # small entries inline: a hand-off to the thread costs more than their checksum
            if len(buf) >= _CRC_THREAD_MIN:
                held = [buf]  # the thread's only hold on the bytes: emptied once their checksum is known
                crcs.append(crc_pool.submit(_crc_of, held))
                big = True
            else:
                held = None
                crcs.append(crc32(buf))
            out.put(offset, buf)
            buf = None
            if one_at_a_time and held is not None:
                crcs[-1] = crcs[-1].result()
                held.clear()
            if advance is not None and e.kind != fmt.KIND_BYTES:
                advance(e.length + extra.get(i, 0))
        if big:
            crcs = [c if type(c) is int else c.result() for c in crcs]
        crcs = _with_aliases(crcs, own, aliases)
        out.finish(plan.header(crcs))
        return crcs
    finally:
        crc_pool.shutdown(wait=True)


def _crc_of(held: list[Any]) -> int:
    return crc32(held[0])


def _with_aliases(crcs: list[int], own: Sequence[int], aliases: Mapping[int, int]) -> list[int]:
    """Every entry's CRC-32, in input order, from the written ones': an alias has its canonical entry's."""
    if not aliases:
        return crcs
    full = [0] * (len(own) + len(aliases))
    for i, c in zip(own, crcs):
        full[i] = c
    for i, j in aliases.items():  # j is written, never itself an alias
        full[i] = full[j]
    return full
