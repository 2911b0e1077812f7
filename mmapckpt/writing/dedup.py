"""Unchanged chunks stored once: a shard written against the chunks its sibling steps already hold.

A save with ``MmapWriter(path, reuse=[...])`` hashes each tensor chunk (BLAKE3 of its bytes,
docs/format.md 2.7) and compares it with the chunk of the same name and chunk offsets that one
of the reused steps holds (:class:`ReuseIndex`, built by dcp/reuse.py from their shard headers).
Where the hash, dtype, shape and length are equal, the chunk's storage record names the stored
bytes (:class:`Reference`: ``../step-M/FILE``, offset, length) and nothing is written; every
other entry is written as the one shard writer writes it, with its hash in the header, so that
the next save can compare with it.

The hashing overlaps the writes: helper threads hash the next chunks (BLAKE3 releases the GIL)
while this one copies the current chunk to the file. A chunk is held back for its whole hash only
where it may equal a stored one: same name, chunk offsets, dtype and shape, and the same CRC-32 of
its first 64 KiB (recorded beside the hash); any other chunk is written at once while its hash is
computed, for the header, on a helper thread. The
header is reserved at the width it would have if every entry were written (writing/shard.py's
layout); offsets are given as entries are decided, so a file holds only the bytes it writes, and
it is cut to its size before it is finished. A shard whose every entry is referenced is not
written at all.
"""

from __future__ import annotations

import os
import zlib
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Mapping, NamedTuple, Sequence

from ..errors import CheckpointWriteError
from ..format import layout as fmt
from ..storage.base import CheckpointStorage, FileOutput
from .tensors import entry_bytes

__all__ = ["Reference", "Reusable", "ReuseIndex", "chunk_hash", "require_hasher", "write_deduplicated"]


class Reference(NamedTuple):
    """A chunk not written: its bytes are ``length`` bytes at ``offset`` of ``file`` (``../step-M/FILE``)."""

    file: str
    offset: int
    length: int


class Reusable(NamedTuple):
    """A chunk a reused step holds: its content hash, where its bytes are (relative to the step being
    written: ``../step-M/FILE``) and what they are."""

    hash: str
    file: str
    offset: int
    length: int
    dtype: str
    shape: tuple[int, ...]
    head: int | None = None  # CRC-32 of the first HEAD_BYTES, where the header records it


class ReuseIndex:
    """The chunks of the reused steps by (fqn, chunk offsets), and the save id each of their files carries."""

    def __init__(self, chunks: Mapping[tuple[str, tuple[int, ...]], Reusable], save_ids: Mapping[str, str]) -> None:
        self.chunks = dict(chunks)
        #: "../step-M/FILE" -> the save id its header carries (checked when the index was built)
        self.save_ids = dict(save_ids)

    def candidate(self, e: Any, head: int) -> bool:
        """Whether entry ``e``, whose first bytes have CRC-32 ``head``, may equal a stored chunk (else it is
        written at once, without waiting for its whole hash)."""
        r = self.chunks.get((e.fqn, e.chunk_offsets))
        return r is not None and r.length == e.length and r.dtype == e.dtype and r.shape == e.shape and (
            r.head is None or r.head == head)

    def match(self, e: Any, digest: str) -> Reference | None:
        """The stored chunk equal to entry ``e`` (fqn, chunk offsets, dtype, shape, length) of hash ``digest``."""
        r = self.chunks.get((e.fqn, e.chunk_offsets))
        if r is None or r.hash != digest or r.length != e.length or r.dtype != e.dtype or r.shape != e.shape:
            return None
        return Reference(r.file, r.offset, r.length)


def require_hasher(where: str) -> Any:
    """The ``blake3`` constructor, or a CheckpointWriteError saying how to install it."""
    try:
        from blake3 import blake3
    except ImportError:
        raise CheckpointWriteError("reuse= (chunks stored once across steps) hashes chunks with BLAKE3, and the "
                                   "blake3 package is not installed: pip install 'mmapckpt[dedup]' "
                                   "(or blake3), or save without reuse", path=where) from None
    return blake3


def chunk_hash(data: Any) -> str:
    """The content hash the format records (docs/format.md 2.7): BLAKE3-256 of the bytes, lowercase hex."""
    from blake3 import blake3
    return blake3(data).hexdigest()


#: Chunks at least this long are hashed (and checksummed) on helper threads; smaller ones inline.
_THREAD_MIN = 1 << 20
#: How many chunks are resolved and hashed ahead of the one being written, each on a helper thread: a save
#: that refers to most of its chunks is bound by hashing (measured: 1.5-3.4 GB/s a thread here), so it uses
#: the cores there are, up to four.
_AHEAD = max(2, min(4, os.cpu_count() or 1))


def write_deduplicated(storage: CheckpointStorage, name: str, entries: Sequence[Any], resolve: Callable[[Any], Any],
                       *, save_id: str | None, alignment: int, direct: bool, sync: bool,
                       aliases: Mapping[int, int] | None, index: ReuseIndex, at: Any,
                       ) -> tuple[list[fmt.Entry | Reference], str]:
    """Shard ``name`` of ``entries`` (writing/shard.py ``ShardEntry``), each tensor chunk equal to one
    ``index`` holds not written but returned as a :class:`Reference`; the others returned as written entries
    (as ``write_shard`` returns them), in input order, and how the bytes travelled (``"referenced"``: no file).
    ``at.index`` follows the entry being written (for the error that names it); the caller aborts on failure."""
    aliases = aliases or {}
    plan = fmt.plan_shard(entries, alignment, save_id, aliases, hashed=True)  # the header's upper bound
    own = [i for i in range(len(entries)) if i not in aliases]
    first = min((plan.entries[i].offset for i in own), default=plan.file_size)
    out = storage.create_file(name, plan.file_size, head=first, direct=direct, sync=sync)
    try:
        placed, hashes, end = _place(out, entries, own, resolve, index, first, alignment, at)
        _add_aliases(entries, placed, hashes, aliases)
        written = [i for i, p in enumerate(placed) if type(p) is not Reference]
        if not written:
            out.abort()
            return placed, "referenced"
        out.shrink(fmt._align_up(max(end, first), alignment))
        out.finish(fmt.encode_header([placed[i] for i in written], save_id,  # type: ignore[misc]
                                     [hashes[i] for i in written]))
    except BaseException:
        out.abort()
        raise
    return placed, out.how


def _place(out: FileOutput, entries: Sequence[Any], own: Sequence[int], resolve: Callable[[Any], Any],
           index: ReuseIndex, first: int, alignment: int, at: Any) -> tuple[list[Any], list[Any], int]:
    """Every own entry referenced or written at the next free aligned offset: (per entry its Entry or
    Reference, None for aliases; per entry its hash or None; the end of the last byte written)."""
    placed: list[Any] = [None] * len(entries)
    hashes: list[Any] = [None] * len(entries)  # per entry: (hash, head CRC-32), or a future of the hash first
    crcs: dict[int, Any] = {}
    pos = first
    pool = ThreadPoolExecutor(_AHEAD, thread_name_prefix="mmapckpt-hash")  # hashes ahead, CRC-32s behind
    try:
        ahead: deque[tuple[int, Any, Any]] = deque()

        def decide(i: int, buf: Any, digest: Any, head: int) -> None:
            nonlocal pos
            e = entries[i]
            if len(buf) != e.length:
                raise ValueError(f"{e.label}: {len(buf)} bytes resolved, {e.length} planned")
            if digest is not None:
                if not index.candidate(e, head):  # changed: written now, its hash known later
                    hashes[i] = (digest, head)
                else:
                    digest = digest if type(digest) is str else digest.result()
                    hashes[i] = (digest, head)
                    ref = index.match(e, digest)
                    if ref is not None:
                        placed[i] = ref
                        return
            pos = fmt._align_up(pos, fmt.entry_alignment(e.length, alignment))
            placed[i] = fmt.Entry(e.fqn, e.chunk_offsets, e.kind, e.dtype, e.shape, pos, e.length, 0)
            crcs[i] = pool.submit(zlib.crc32, buf) if len(buf) >= _THREAD_MIN else zlib.crc32(buf)
            out.put(pos, buf)
            pos += e.length

        for i, buf in entry_bytes(entries, own, resolve, at):
            e = entries[i]
            digest, head = None, 0
            if e.kind == fmt.KIND_TENSOR and e.length:
                digest = pool.submit(chunk_hash, buf) if len(buf) >= _THREAD_MIN else chunk_hash(buf)
                head = zlib.crc32(memoryview(buf)[:fmt.HEAD_BYTES])
            ahead.append((i, buf, digest, head))
            buf = None
            if len(ahead) > _AHEAD:
                decide(*ahead.popleft())
        while ahead:
            decide(*ahead.popleft())
        for i, c in crcs.items():
            placed[i] = placed[i]._replace(crc32=c if type(c) is int else c.result())
        for i, h in enumerate(hashes):
            if h is not None and type(h[0]) is not str:
                hashes[i] = (h[0].result(), h[1])
        return placed, hashes, pos
    finally:
        pool.shutdown(wait=True)


def _add_aliases(entries: Sequence[Any], placed: list[Any], hashes: list[Any],
                 aliases: Mapping[int, int]) -> None:
    """Tied weights: an alias names its canonical entry's bytes, written (an entry of its own name at the same
    place: docs/format.md 2.6) or referenced (the same reference)."""
    for i, j in aliases.items():
        hashes[i], p = hashes[j], placed[j]
        placed[i] = p if type(p) is Reference else p._replace(fqn=entries[i].fqn,
                                                                 chunk_offsets=entries[i].chunk_offsets)
