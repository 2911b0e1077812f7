"""Unchanged chunks stored once: a shard written against the chunks its sibling steps already hold.

A save with ``MmapWriter(path, reuse=[...])`` hashes each tensor chunk (BLAKE3 of its bytes,
docs/format.md 2.7) and compares it with the chunk of the same name and chunk offsets that one
of the reused steps holds (:class:`ReuseIndex`, built by dcp/reuse.py from their shard headers).
Where the hash, dtype, shape and length are equal, the chunk's storage record names the stored
bytes (:class:`Reference`: ``../step-M/FILE``, offset, length) and nothing is written; every
other entry is written as the one shard writer writes it, with its hash in the header, so that
the next save can compare with it: on an object store, and in the first step of a root on every medium
(``ReuseIndex.hash_written``). In a later step on a local disk a written chunk carries its CRC-32 alone
(hash on second sight): a later chunk that may equal
such an unhashed stored one is compared with the stored bytes byte for byte (``ReuseIndex.compare``,
on a helper thread, which hashes them meanwhile) and referenced only where all are equal; the hash
is kept for the next save of the same manager (``ReuseIndex.confirmed``), which then matches by it.

The hashing overlaps the writes. A chunk is held back for its whole hash only where it may equal a
stored one: same name, chunk offsets, dtype and shape, and the same CRC-32 of its first 64 KiB
(recorded beside the hash); its hash is computed on a helper thread (BLAKE3 releases the GIL) while
the chunks after it are resolved, and those that changed are written meanwhile. Any other chunk is
written at once, its CRC-32 and hash computed in one pass over its bytes on a helper thread while
this one copies them to the file. The header is reserved at the width it would have if every entry
were written (writing/shard.py's layout); offsets are given as entries are decided, so a file holds
only the bytes it writes, in the order they were decided, and it is cut to its size before it is
finished. A shard whose every entry is referenced is not written at all.

BLAKE3: a cryptographic hash (256 bits; no two different chunks are known to share one, so equal
hashes stand for equal bytes) that is also the fastest such on a CPU (SIMD, 4.4-6.4 GB/s a thread
here, beside 14-19 GB/s for the CRC-32 of format/crc.py, which only detects damage).
"""

from __future__ import annotations

import os
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Mapping, Sequence

from ..errors import CheckpointWriteError
from ..format.crc import crc32
from ..format import layout as fmt
from ..records import Record
from ..storage.base import CheckpointStorage, FileOutput
from .tags import Tagger
from .tensors import entry_bytes

__all__ = ["Reference", "Reusable", "ReuseIndex", "chunk_hash", "require_hasher", "write_deduplicated"]


class Reference(Record):
    """A chunk not written: its bytes are ``length`` bytes at ``offset`` of ``file`` (``../step-M/FILE``)."""

    __slots__ = ()

    file: str
    offset: int
    length: int

    def __new__(cls, file: str, offset: int, length: int) -> Reference:
        return tuple.__new__(cls, (file, offset, length))


class Reusable(Record):
    """A chunk a reused step holds: its content hash, where its bytes are (relative to the step being
    written: ``../step-M/FILE``) and what they are."""

    __slots__ = ()

    hash: str | None  # None: not recorded (compared byte for byte with the chunk, then hashed: ReuseIndex.confirm)
    file: str
    offset: int
    length: int
    dtype: str
    shape: tuple[int, ...]
    head: int | None  # CRC-32 of the first HEAD_BYTES, where the header records it
    tag: bytes | None  # the manager's equality tag of the stored bytes, where it knows it (writing/tags.py)

    def __new__(cls, hash: str | None, file: str, offset: int, length: int, dtype: str, shape: tuple[int, ...],
                head: int | None = None, tag: bytes | None = None) -> Reusable:
        return tuple.__new__(cls, (hash, file, offset, length, dtype, shape, head, tag))


class ReuseIndex:
    """The chunks of the reused steps by (fqn, chunk offsets), and the save id each of their files carries."""

    def __init__(self, chunks: Mapping[tuple[str, tuple[int, ...]], Reusable], save_ids: Mapping[str, str], *,
                 hash_written: bool = True, compare: Callable[[Reusable, Any], str | None] | None = None,
                 stored: Mapping[str, dict[Any, Any]] | None = None, tagger: Tagger | None = None) -> None:
        self.chunks = dict(chunks)
        #: the manager's equality tags (writing/tags.py), None without a manager (nothing would keep them) or
        #: without the ``cryptography`` package: a chunk whose stored bytes have a tag is compared by it alone;
        #: a chunk hashed or compared byte for byte is tagged as well, for the manager's next save
        self.tagger = tagger
        #: whether a chunk written because no stored chunk may equal it is hashed all the same (a root's first step,
        #: and an object store, where a later save cannot read stored bytes cheaply), or written with its CRC-32
        #: alone (a later step on a local disk)
        self.hash_written = hash_written
        #: ``compare(r, buf)``: the content hash of ``buf`` where its bytes equal those of stored chunk ``r`` (read
        #: and compared byte for byte), else None; None where stored bytes are not read (the unhashed are skipped)
        self.compare = compare
        #: "../step-M/FILE" -> the hashes its header records, as the manager's HeaderCache keeps them
        #: (``(hash, offset, head CRC-32, tag)``): a hash found by ``compare`` and a tag computed are added
        #: there, so that the manager's next save matches the chunk by them
        self.stored = stored if stored is not None else {}
        #: "../step-M/FILE" -> the save id its header carries (checked when the index was built)
        self.save_ids = dict(save_ids)
        #: shard file name -> ((its size, its preamble), its header's hashes as ``Shard.hashes`` gives them), of
        #: the files this save wrote: what the next save of the same manager would read of them (dcp/reuse.py)
        #: (a written chunk's hash is None where it was written with its CRC-32 alone; its tag None where untagged)
        self.written: dict[str, tuple[tuple[int, bytes],
                                      dict[tuple[str, tuple[int, ...]],
                                           tuple[str | None, int, int, bytes | None]]]] = {}

    def candidate(self, e: Any, head: int) -> bool:
        """Whether entry ``e``, whose first bytes have CRC-32 ``head``, may equal a stored chunk (else it is
        written at once, without waiting for its whole hash)."""
        r = self.chunks.get((e.fqn, e.chunk_offsets))
        return r is not None and r.length == e.length and r.dtype == e.dtype and r.shape == e.shape and (
            r.head is None or r.head == head) and (r.hash is not None or self.compare is not None
                                                    or self.by_tag(r))

    def by_tag(self, r: Reusable) -> bool:
        """Whether stored chunk ``r`` is compared by its equality tag alone."""
        return r.tag is not None and self.tagger is not None

    def confirmed(self, e: Any, digest: str | None, head: int, tag: bytes | None) -> Reference:
        """Entry ``e``'s bytes were found equal to the stored chunk of its name (by ``compare``, its hash or its
        tag), of hash ``digest`` (None: unhashed, matched by tag) and tag ``tag`` (None: untagged): the reference
        to it, and what is known of it kept for the next save (``stored``, ``chunks``)."""
        key = (e.fqn, e.chunk_offsets)
        r = self.chunks[key] = self.chunks[key]._replace(hash=digest, head=head, tag=tag)
        kept = self.stored.get(r.file)
        if kept is not None:
            kept[key] = (digest, r.offset, head, tag)
        return Reference(r.file, r.offset, r.length)

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
#: Helper threads: a save that refers to most of its chunks is bound by hashing (BLAKE3, 4.4-6.4 GB/s a
#: thread here), so it uses the cores there are, up to four.
_THREADS = max(2, min(4, os.cpu_count() or 1))
#: How many bytes (and chunks) that may equal a stored one are held while their hashes are computed, so that
#: the chunks after them that changed are written meanwhile: views of the caller's CPU tensors cost nothing
#: held, a device tensor's staged copy its size.
_PENDING_BYTES, _PENDING_CHUNKS = 256 << 20, 64
#: A chunk both checksummed and hashed is read in pieces of this size, each hashed while it is in cache.
_PIECE = 1 << 20


def _crc_and_hash(buf: Any, hashed: bool, tagger: Tagger | None) -> tuple[int, str | None, bytes | None]:
    """The CRC-32 of ``buf`` and, where ``hashed``, its content hash, from one pass over its bytes, and its
    tag where ``hashed`` and ``tagger`` (a second pass: GMAC is fastest fed whole, 3-4 times BLAKE3)."""
    if not hashed:
        return crc32(buf), None, None
    from blake3 import blake3
    h, crc, mv = blake3(), 0, memoryview(buf)
    for o in range(0, len(mv), _PIECE):
        piece = mv[o:o + _PIECE]
        crc = crc32(piece, crc)
        h.update(piece)
    return crc, h.hexdigest(), None if tagger is None else tagger.tag(buf)


def _tag_only(buf: Any, tagger: Tagger) -> tuple[None, bytes]:
    """The tag of ``buf`` (no content hash), shaped as :func:`_hash_and_tag`'s answer."""
    return None, tagger.tag(buf)


def _hash_and_tag(buf: Any, tagger: Tagger | None) -> tuple[str, bytes | None]:
    """The content hash of ``buf`` and, with ``tagger``, its tag."""
    return chunk_hash(buf), None if tagger is None else tagger.tag(buf)


def _compare_and_tag(compare: Callable[[Reusable, Any], str | None], r: Reusable, buf: Any,
                     tagger: Tagger | None) -> tuple[str | None, bytes | None]:
    """``compare(r, buf)`` and, where the bytes are equal and ``tagger`` given, the tag of ``buf``."""
    digest = compare(r, buf)
    return digest, None if digest is None or tagger is None else tagger.tag(buf)


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
    # entries are written in the order they are decided, not planned: room for any order's padding
    most = fmt._align_up(first + sum(entries[i].length + fmt.entry_alignment(entries[i].length, alignment)
                                      for i in own), alignment)
    out = storage.create_file(name, most, head=first, direct=direct, sync=sync)
    try:
        placed, hashes, tags, end = _place(out, entries, own, resolve, index, first, alignment, at)
        _add_aliases(entries, placed, hashes, aliases)
        written = [i for i, p in enumerate(placed) if type(p) is not Reference]
        if not written:
            out.abort()
            return placed, "referenced"
        size = fmt._align_up(max(end, first), alignment)
        out.shrink(size)
        head = fmt.encode_header([placed[i] for i in written], save_id,
                                 [hashes[i] if hashes[i] is not None and hashes[i][0] is not None else None
                                  for i in written])
        out.finish(head)
    except BaseException:
        out.abort()
        raise
    index.written[name] = ((size, head[:fmt.PREAMBLE_SIZE]), {
        (placed[i].fqn, placed[i].chunk_offsets): (hashes[i][0], placed[i].offset, hashes[i][1], tags.get(i))
        for i in written if hashes[i] is not None and placed[i].kind == fmt.KIND_TENSOR})
    return placed, out.how


def _place(out: FileOutput, entries: Sequence[Any], own: Sequence[int], resolve: Callable[[Any], Any],
           index: ReuseIndex, first: int, alignment: int, at: Any,
           ) -> tuple[list[Any], list[Any], dict[int, bytes], int]:
    """Every own entry referenced or written at the next free aligned offset: (per entry its Entry or
    Reference, None for aliases; per entry its hash or None; the equality tags known of the entries written;
    the end of the last byte written).

    A tensor chunk that may equal a stored one (:meth:`ReuseIndex.candidate`) waits, with its tag, or else its
    hash (and tag), computed on a helper thread, among at most ``_PENDING_BYTES`` held; every other entry is
    written at once, its CRC-32 and hash computed in one pass on a helper thread while the bytes are copied out.
    A held chunk whose tag or hash matches is referenced, any other written when it is known: the file's entries
    are in the order they were decided."""
    placed: list[Any] = [None] * len(entries)
    hashes: list[Any] = [None] * len(entries)  # per entry: (hash, head CRC-32)
    tags: dict[int, bytes] = {}  # per written entry whose tag is known
    sums: dict[int, Any] = {}  # per written entry: (CRC-32, hash or None, tag or None), or a future of it
    tagger = index.tagger
    pos = first
    pool = ThreadPoolExecutor(_THREADS, thread_name_prefix="mmapckpt-hash")
    try:
        pending: deque[tuple[int, Any, Any, int, str]] = deque()  # (entry, bytes, answer, head, how)
        held = 0

        def write(i: int, buf: Any, digest: str | None, head: int, tag: bytes | None = None) -> None:
            nonlocal pos
            e = entries[i]
            at.index = i
            pos = fmt._align_up(pos, fmt.entry_alignment(e.length, alignment))
            placed[i] = fmt.Entry(e.fqn, e.chunk_offsets, e.kind, e.dtype, e.shape, pos, e.length, 0)
            hashed = digest is None and e.kind == fmt.KIND_TENSOR and e.length > 0 and index.hash_written
            hashes[i] = (digest, head) if e.kind == fmt.KIND_TENSOR and e.length else None
            if tag is not None:
                tags[i] = tag
            tagging = tagger if tag is None else None  # a tag already computed is not computed again
            sums[i] = (pool.submit(_crc_and_hash, buf, hashed, tagging) if len(buf) >= _THREAD_MIN
                       else _crc_and_hash(buf, hashed, tagging))
            out.put(pos, buf)
            pos += e.length

        def settle() -> None:
            nonlocal held
            i, buf, got, head, how = pending.popleft()
            held -= len(buf)
            got = got if type(got) is tuple else got.result()
            e, r = entries[i], index.chunks[(entries[i].fqn, entries[i].chunk_offsets)]
            if how == "tag":  # compared by the stored bytes' tag alone: equal bytes, or written again
                if got[1] == r.tag:
                    hashes[i], placed[i] = (r.hash, head), index.confirmed(e, r.hash, head, r.tag)
                else:
                    write(i, buf, None, head, got[1])
                return
            digest, tag = got
            if how == "compared":  # an unhashed stored chunk: compared byte for byte, digest None where they differ
                if digest is not None:
                    hashes[i], placed[i] = (digest, head), index.confirmed(e, digest, head, tag)
                else:
                    write(i, buf, None, head)
                return
            if index.match(e, digest) is not None:
                hashes[i], placed[i] = (digest, head), index.confirmed(e, digest, head, tag)
            else:
                write(i, buf, digest, head, tag)

        for i, buf in entry_bytes(entries, own, resolve, at):
            e = entries[i]
            if len(buf) != e.length:
                raise ValueError(f"{e.label}: {len(buf)} bytes resolved, {e.length} planned")
            head = crc32(memoryview(buf)[:fmt.HEAD_BYTES]) if e.kind == fmt.KIND_TENSOR and e.length else 0
            if e.kind == fmt.KIND_TENSOR and e.length and index.candidate(e, head):
                r = index.chunks[(e.fqn, e.chunk_offsets)]
                if index.by_tag(r):
                    assert tagger is not None  # by_tag() (an invariant of ours)
                    how, job, args = "tag", _tag_only, (buf, tagger)
                elif r.hash is None:
                    assert index.compare is not None  # candidate() (an invariant of ours)
                    how, job, args = "compared", _compare_and_tag, (index.compare, r, buf, tagger)
                else:
                    how, job, args = "hashed", _hash_and_tag, (buf, tagger)
                pending.append((i, buf, pool.submit(job, *args) if len(buf) >= _THREAD_MIN or how == "compared"
                                else job(*args), head, how))
                held += len(buf)
                while pending and (held > _PENDING_BYTES or len(pending) > _PENDING_CHUNKS
                                   or type(pending[0][2]) is tuple or pending[0][2].done()):
                    settle()
            else:
                write(i, buf, None, head)
            buf = None
        while pending:
            settle()
        for i, c in sums.items():
            crc, digest, tag = c if type(c) is tuple else c.result()
            placed[i] = placed[i]._replace(crc32=crc)
            if digest is not None:
                hashes[i] = (digest, hashes[i][1])
            if tag is not None:
                tags[i] = tag
        at.index = None
        return placed, hashes, tags, pos
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
