"""The mmapckpt shard format, version 1: the only module that knows its bytes.

docs/format.md is the specification; this module is its implementation. A shard
file is::

    offset 0   preamble, 32 bytes, little-endian
               magic        8 bytes  b"MMAPCKPT"
               major        u16      1
               minor        u16      0
               byte order   u8       1 = little-endian data, 2 = big-endian data
               reserved     3 bytes  zero
               header_len   u64      length of the JSON header in bytes
               header_crc   u32      CRC-32 (zlib) of the JSON header bytes
               reserved     u32      zero
    offset 32  header, header_len bytes of UTF-8 JSON (see ShardHeader)
    then       entries' data, each at its own aligned offset, zero padding between

The module is pure: no torch.distributed, no file I/O beyond the bytes given.
"""

from __future__ import annotations

import json
import math
import re
import struct
import sys
from json.encoder import encode_basestring_ascii as _quote
from typing import Any, Mapping, Sequence

from .crc import crc32
from ..errors import (BadMagicError, ByteOrderError, EntryBoundsError, FormatError, TruncatedFileError,
                      UnsupportedVersionError)
from .dtypes import _DTYPE_TABLE, ITEMSIZES, NAMED, check_dtype_name, dtype_from_name, dtype_name  # noqa: F401 - the format's names
from ..records import Record
from .tiling import shape_problem

DTYPES: dict[str, tuple[Any, int]]  # name -> (torch.dtype, itemsize), made on first use: see __getattr__

__all__ = [
    "MAGIC", "FORMAT_MAJOR", "FORMAT_MINOR", "PREAMBLE_SIZE", "MAX_HEADER_SIZE", "MIN_ALIGNMENT", "DTYPES",
    "dtype_name", "dtype_from_name", "Entry", "EntrySpec", "ShardHeader", "ShardPlan", "plan_shard",
    "layout_entries", "encode_header", "header_crcs", "header_agrees", "entry_hashes", "HASH_KEY", "decode_preamble", "decode_header_doc", "decode_header",
    "host_byte_order",
]

MAGIC = b"MMAPCKPT"
FORMAT_MAJOR = 1
FORMAT_MINOR = 0
#: The minor version of a shard whose tensor entries carry content hashes (``HASH_KEY``; readers of 1.0 ignore it).
FORMAT_MINOR_HASHES = 1
#: The entry key of a tensor entry's content hash: BLAKE3 of its data bytes, 64 lowercase hex digits
#: (docs/format.md 2.7); what a later save of the same root compares its chunks with.
HASH_KEY = "blake3"
#: The entry key of the CRC-32 of a hashed entry's first ``HEAD_BYTES`` bytes (8 hex digits): a save compares it
#: first, and writes a chunk whose head differs at once, without waiting for its whole hash (2.7).
HEAD_KEY = "crc32_head"
HEAD_BYTES = 1 << 16
_HASH_FIELD_LEN = len(f',"{HASH_KEY}":"","{HEAD_KEY}":""') + 64 + 8
PREAMBLE_SIZE = 32
#: Headers larger than this are refused before they are read (safetensors uses the same bound).
MAX_HEADER_SIZE = 100 * 1024 * 1024
#: Every entry's data offset is a multiple of this.
MIN_ALIGNMENT = 64
MAX_NDIM = 64
BYTE_ORDER_LITTLE = 1
BYTE_ORDER_BIG = 2
KIND_TENSOR = "tensor"
KIND_BYTES = "bytes"
#: A tensor chunk or a non-tensor value stored through DCP stream transforms (compression,
#: encryption): ``length`` is the stored length, ``transforms`` the descriptors to undo them.
KIND_ENCODED = "encoded"

_PREAMBLE = struct.Struct("<8sHHB3xQI4x")
assert _PREAMBLE.size == PREAMBLE_SIZE

def host_byte_order() -> int:
    return BYTE_ORDER_LITTLE if sys.byteorder == "little" else BYTE_ORDER_BIG


class EntrySpec(Record):
    """What the writer knows of an entry before laying it out."""

    __slots__ = ()

    fqn: str
    chunk_offsets: tuple[int, ...] | None  # None for non-tensor (bytes) entries
    kind: str
    dtype: str | None
    shape: tuple[int, ...]
    length: int

    def __new__(cls, fqn: str, chunk_offsets: tuple[int, ...] | None, kind: str, dtype: str | None,
                shape: tuple[int, ...], length: int) -> EntrySpec:
        return tuple.__new__(cls, (fqn, chunk_offsets, kind, dtype, shape, length))


class Entry(Record):
    """One entry of a shard header: where its bytes are and what they are (``_replace`` gives a changed copy)."""

    __slots__ = ()

    fqn: str
    chunk_offsets: tuple[int, ...] | None
    kind: str
    dtype: str | None
    shape: tuple[int, ...]
    offset: int
    length: int
    crc32: int
    #: for KIND_ENCODED: the stream-transform descriptors, in the order DCP's ``_StorageInfo`` keeps them
    transforms: tuple[str, ...]

    def __new__(cls, fqn: str, chunk_offsets: tuple[int, ...] | None, kind: str, dtype: str | None,
                shape: tuple[int, ...], offset: int, length: int, crc32: int,
                transforms: tuple[str, ...] = ()) -> Entry:
        return tuple.__new__(cls, (fqn, chunk_offsets, kind, dtype, shape, offset, length, crc32, transforms))

    @property
    def key(self) -> tuple[str, tuple[int, ...] | None]:
        return (self.fqn, self.chunk_offsets)

    @property
    def label(self) -> str:
        return self.fqn if self.chunk_offsets is None else f"{self.fqn}@{list(self.chunk_offsets)}"

    def to_json(self) -> dict[str, Any]:
        """The entry's header object (what :func:`encode_header` writes, as a dict)."""
        return json.loads(_entry_head(self) + f'{self.offset},"length":{self.length},"crc32":"{self.crc32:08x}"}}')


def _entry_head(e: Entry | EntrySpec) -> str:
    """An entry's header object up to its offset's digits (offset, length, crc32 come last), by hand: a tenth
    of ``json.dumps``'s cost, the same bytes as ``json.dumps(..., separators=(",", ":"), ensure_ascii=True)``."""
    return f'{{"fqn":{_quote(e.fqn)}{_entry_rest(e)}'


def _entry_rest(e: Entry | EntrySpec) -> str:
    """:func:`_entry_head` after the name (the same for every chunk of one dtype, shape and place)."""
    rest = f',"kind":{_quote(e.kind)}'
    if e.kind == KIND_TENSOR or (e.kind == KIND_ENCODED and e.chunk_offsets is not None):
        rest += (f',"chunk_offsets":[{",".join(map(str, e.chunk_offsets or ()))}],"dtype":{_quote(e.dtype)}'
                 f',"shape":[{",".join(map(str, e.shape))}]')
    if e.kind == KIND_ENCODED:
        rest += f',"transforms":[{",".join(map(_quote, e.transforms))}]'  # type: ignore[union-attr]
    return rest + ',"offset":'


class ShardHeader:
    """A decoded shard header. ``data_start`` is the first byte after the header.

    A plain class (not a dataclass: building one costs about half a millisecond of every new process's first load).
    """

    __slots__ = ("entries", "data_start", "byte_order", "minor", "save_id")

    def __init__(self, entries: tuple[Entry, ...], data_start: int, byte_order: int, minor: int,
                 save_id: str | None = None) -> None:
        self.entries, self.data_start, self.byte_order, self.minor = entries, data_start, byte_order, minor
        #: The id of the save that wrote this shard (matches the metadata's storage_meta.save_id), if recorded.
        self.save_id = save_id

    def __repr__(self) -> str:
        return (f"ShardHeader({len(self.entries)} entries, data_start={self.data_start}, "
                f"byte_order={self.byte_order}, minor={self.minor}, save_id={self.save_id!r})")

    def by_key(self) -> dict[tuple[str, tuple[int, ...] | None], Entry]:
        return {e.key: e for e in self.entries}


def _align_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def entry_alignment(length: int, alignment: int) -> int:
    """Entries at least ``alignment`` bytes long start on an ``alignment`` boundary."""
    return alignment if length >= alignment else MIN_ALIGNMENT


class ShardPlan(Record):
    """A shard file laid out: its entries (CRC-32s still 0), its size, and its header's text but the checksums."""

    __slots__ = ()

    entries: list[Entry]
    file_size: int
    save_id: str | None
    heads: list[str]  # per entry: its header object up to the crc32 value

    def __new__(cls, entries: list[Entry], file_size: int, save_id: str | None, heads: list[str]) -> ShardPlan:
        return tuple.__new__(cls, (entries, file_size, save_id, heads))

    def header(self, crcs: Sequence[int]) -> bytes:
        """The preamble and JSON header with each entry's CRC-32 (what :func:`encode_header` gives)."""
        return _framed(self.save_id, [f'{h}{c:08x}"}}' for h, c in zip(self.heads, crcs)])


def plan_shard(specs: Sequence[EntrySpec], alignment: int = 4096, save_id: str | None = None,
               aliases: Mapping[int, int] | None = None, *, hashed: bool = False) -> ShardPlan:
    """Give every entry an aligned data offset after the header.

    ``aliases`` {i: j < i}: spec ``i`` is an exact alias of spec ``j`` (format/aliases.py) and
    gets ``j``'s bytes, which are written once. The header's length depends on the offsets'
    digits: it is reserved with every offset as wide as the largest the file can have (the
    checksums are fixed-width), so that one pass lays the file out.
    """
    if alignment < MIN_ALIGNMENT or alignment & (alignment - 1):
        raise ValueError(f"alignment must be a power of two >= {MIN_ALIGNMENT}, got {alignment}")
    rests: dict[tuple[Any, ...], str] = {}
    heads = []
    for s in specs:
        r = rests.get(k := s[1:5])  # chunk_offsets, kind, dtype, shape
        if r is None:
            r = rests[k] = _entry_rest(s)
        heads.append(f'{{"fqn":{_quote(s.fqn)}{r}')
    tails = [f',"length":{s.length},"crc32":"' for s in specs]
    fixed = len(_framed(save_id, [])) + sum(map(len, heads)) + sum(map(len, tails))
    fixed += len(specs) * 11  # per entry: 8 hex digits, '"}' and a comma
    if hashed:  # room for every tensor entry's content hash (written by a save that compares chunks)
        fixed += sum(_HASH_FIELD_LEN for s in specs if s.kind == KIND_TENSOR) + 16  # and the minor version
    most = sum(s.length + entry_alignment(s.length, alignment) for s in specs)  # data and the padding before each
    width = 1
    while len(str(_align_up(fixed + len(specs) * width, MIN_ALIGNMENT) + most)) > width:
        width += 1
    data_start = _align_up(fixed + len(specs) * width, MIN_ALIGNMENT)
    entries: list[Entry] = []
    pos = data_start
    for i, s in enumerate(specs):
        if aliases and i in aliases:
            entries.append(entries[aliases[i]]._replace(fqn=s.fqn, chunk_offsets=s.chunk_offsets))
            heads[i] = _entry_head(s) + f'{entries[i].offset},"length":{s.length},"crc32":"'
            continue
        pos = _align_up(pos, entry_alignment(s.length, alignment))
        entries.append(Entry(s.fqn, s.chunk_offsets, s.kind, s.dtype, s.shape, pos, s.length, 0))
        heads[i] = f"{heads[i]}{pos}{tails[i]}"
        pos += s.length
    return ShardPlan(entries, _align_up(max(pos, data_start), alignment), save_id, heads)


def layout_entries(specs: Sequence[EntrySpec], alignment: int = 4096, save_id: str | None = None,
                   aliases: Mapping[int, int] | None = None) -> tuple[list[Entry], int]:
    return plan_shard(specs, alignment, save_id, aliases)[:2]  # type: ignore[return-value]  # plan_shard's entries, size


def _framed(save_id: str | None, objects: list[str], minor: int = FORMAT_MINOR) -> bytes:
    """The preamble and the header document around the entries' objects."""
    body = _document(save_id, objects).encode("ascii")
    return _PREAMBLE.pack(MAGIC, FORMAT_MAJOR, minor, host_byte_order(), len(body), crc32(body)) + body


def _document(save_id: str | None, objects: list[str]) -> str:
    sid = "" if save_id is None else f',"save_id":{_quote(save_id)}'
    return f'{{"format":"mmapckpt"{sid},"entries":[{",".join(objects)}]}}'


# patterns, compiled by ``re`` on first use and kept in its cache (compiling them at import costs every new process)
_HASH_FIELD = r',"blake3":"[0-9a-f]{64}"(,"crc32_head":"[0-9a-f]{8}")?'
_HASH_VALUE = r"[0-9a-f]{64}"
_HEAD_VALUE = r"[0-9a-f]{8}"
#: the characters of a CRC-32 as the writer spells it
_HEX = frozenset("0123456789abcdef")


def header_crcs(body: bytes, save_id: str | None, records: Sequence[tuple[Any, ...]]) -> list[int] | None:
    """The entries' CRC-32s if ``body`` is byte for byte the header written for ``records`` (fqn, chunk_offsets,
    kind, dtype name, shape, offset, length; in the header's order), else None: a whole header checked against
    the metadata without decoding it."""
    crcs = _agreeing_crcs(body, save_id, records)
    return None if crcs is None else [int(c, 16) for c in crcs]


def header_agrees(body: bytes, save_id: str | None, records: Sequence[tuple[Any, ...]]) -> bool:
    """Whether ``body`` is byte for byte the header written for ``records`` (:func:`header_crcs`, without making
    the CRC-32s numbers: what a reader opening a shard asks, once per tensor)."""
    return _agreeing_crcs(body, save_id, records) is not None


def _agreeing_crcs(body: bytes, save_id: str | None, records: Sequence[tuple[Any, ...]]) -> list[str] | None:
    """The entries' CRC-32s in hex if ``body`` is the header written for ``records``, else None."""
    if not body.isascii():
        return None
    text = body.decode("ascii")
    if '"blake3":"' in text:  # content hashes (2.7) are not the metadata's to compare
        text = re.sub(_HASH_FIELD, "", text)
    # each entry's CRC-32 follows its '"crc32":"' (a JSON string holds no bare quote); the document rebuilt from
    # them must then equal the text. No regular expression: compiling it was a new process's cost, the open of a
    # 323-tensor checkpoint 2.93 -> 2.80 ms without it (20 fresh processes, alternating). Once compiled, it found
    # them faster: in a long-lived process this check of a 323-entry header takes 293-297 us against 271-272 us.
    crcs = [p[:8] for p in text.split('"crc32":"')[1:]]
    joined = "".join(crcs)
    if len(crcs) != len(records) or len(joined) != 8 * len(crcs) or not set(joined) <= _HEX:
        return None
    rests: dict[tuple[Any, ...], str] = {}  # an entry's object after its name, per (chunk, kind, dtype, shape)
    for r in records:
        if (k := r[1:5]) not in rests:
            rests[k] = _entry_rest(EntrySpec(r[0], r[1], r[2], r[3], r[4], r[6]))
    objects = [f'{{"fqn":{_quote(fqn)}{rests[chunk, kind, dtype, shape]}{offset},"length":{length},"crc32":"{crc}"}}'
               for (fqn, chunk, kind, dtype, shape, offset, length), crc in zip(records, crcs)]
    return crcs if _document(save_id, objects) == text else None


def encode_header(entries: Sequence[Entry], save_id: str | None = None,
                  hashes: Sequence[tuple[str, int] | None] | None = None) -> bytes:
    """The preamble followed by the JSON header, ready to be written at offset 0.

    ``save_id`` (optional) ties the shard to one save: a reader compares it with the
    metadata's ``storage_meta.save_id`` so that shards of a later save are never read
    through an earlier save's metadata. ``hashes``: each entry's content hash (``HASH_KEY``, hex) and the
    CRC-32 of its head (``HEAD_KEY``), or None; with any, the header is minor version ``FORMAT_MINOR_HASHES``.
    """
    if not hashes or not any(hashes):
        return _framed(save_id, [f'{_entry_head(e)}{e.offset},"length":{e.length},"crc32":"{e.crc32:08x}"}}'
                                 for e in entries])
    return _framed(save_id, [f'{_entry_head(e)}{e.offset},"length":{e.length},{_hash_fields(h)}'
                             f'"crc32":"{e.crc32:08x}"}}' for e, h in zip(entries, hashes)], FORMAT_MINOR_HASHES)


def _hash_fields(h: tuple[str, int] | None) -> str:
    """An entry's content hash and head CRC-32 (2.7), each followed by a comma; "" for none."""
    return "" if h is None else f'"{HASH_KEY}":"{h[0]}","{HEAD_KEY}":"{h[1]:08x}",'


def entry_hashes(doc: Mapping[str, Any], *, unhashed: bool = False,
                 ) -> dict[tuple[str, tuple[int, ...]], tuple[str | None, int, int | None]]:
    """``{(fqn, chunk_offsets): (content hash, offset, CRC-32 of the head or None)}`` of the tensor entries of a
    decoded header document that carry a well-formed hash (2.7); others are left out (a later save writes
    their bytes again), or, with ``unhashed``, given as ``(None, offset, None)`` (a later save on a local disk
    compares their bytes)."""
    out: dict[tuple[str, tuple[int, ...]], tuple[str | None, int, int | None]] = {}
    for e in doc.get("entries", ()):
        if not (isinstance(e, dict) and e.get("kind") == KIND_TENSOR and isinstance(e.get("chunk_offsets"), list)
                and type(e.get("offset")) is int):
            continue
        h = e.get(HASH_KEY)
        if isinstance(h, str) and re.fullmatch(_HASH_VALUE, h):
            head = e.get(HEAD_KEY)
            head = int(head, 16) if isinstance(head, str) and re.fullmatch(_HEAD_VALUE, head) else None
            out[(e["fqn"], tuple(e["chunk_offsets"]))] = (h, e["offset"], head)
        elif unhashed and h is None:
            out[(e["fqn"], tuple(e["chunk_offsets"]))] = (None, e["offset"], None)
    return out


def decode_preamble(pre: bytes, file_size: int, path: str) -> tuple[int, int, int, int]:
    """Validate the 32-byte preamble; return (minor, byte order, header length, header crc)."""
    if file_size < PREAMBLE_SIZE or len(pre) < PREAMBLE_SIZE:
        if pre[: len(MAGIC)] != MAGIC[: len(pre)]:
            raise BadMagicError("not an mmapckpt shard (bad magic bytes)", path=path)
        raise TruncatedFileError(f"file is {file_size} bytes, shorter than the {PREAMBLE_SIZE}-byte preamble", path=path)
    magic, major, minor, order, hlen, hcrc = _PREAMBLE.unpack(pre[:PREAMBLE_SIZE])
    if magic != MAGIC:
        raise BadMagicError(f"not an mmapckpt shard (magic {magic!r}, expected {MAGIC!r})", path=path)
    if major != FORMAT_MAJOR:
        raise UnsupportedVersionError(f"format version {major}.{minor}; this mmapckpt reads version {FORMAT_MAJOR}.x",
                                      path=path)
    if order not in (BYTE_ORDER_LITTLE, BYTE_ORDER_BIG):
        raise FormatError(f"invalid byte-order code {order}", path=path)
    if order != host_byte_order():
        names = {BYTE_ORDER_LITTLE: "little", BYTE_ORDER_BIG: "big"}
        raise ByteOrderError(f"data is {names[order]}-endian but this host is {sys.byteorder}-endian; convert the "
                             "checkpoint on a host of the same byte order", path=path)
    if hlen > MAX_HEADER_SIZE:
        raise FormatError(f"header length {hlen} exceeds the limit of {MAX_HEADER_SIZE} bytes", path=path)
    if PREAMBLE_SIZE + hlen > file_size:
        raise TruncatedFileError(f"header of {hlen} bytes runs past the end of the {file_size}-byte file", path=path)
    return minor, order, hlen, hcrc


#: Every integer in a header (offsets, lengths, dims) must fit torch's int64 sizes.
MAX_INT = 2**63 - 1


def _int(v: object, what: str, path: str, entry: str | None, *, lo: int = 0) -> int:
    if type(v) is not int or not lo <= v <= MAX_INT:  # bool is an int subclass: refuse it too
        raise FormatError(f"{what} must be an integer in [{lo}, 2**63), got {v!r}"[:300], path=path, entry=entry)
    return v


def _int_list(v: object, what: str, path: str, entry: str) -> tuple[int, ...]:
    if not isinstance(v, list) or len(v) > MAX_NDIM:
        raise FormatError(f"{what} must be a list of at most {MAX_NDIM} integers, got {v!r}"[:300], path=path, entry=entry)
    return tuple(_int(x, what, path, entry) for x in v)


def _decode_entry(raw: object, path: str, i: int) -> Entry:
    if not isinstance(raw, dict):
        raise FormatError(f"header entry #{i} is not an object", path=path)
    fqn = raw.get("fqn")
    if not isinstance(fqn, str):
        raise FormatError(f"header entry #{i} has no string 'fqn'", path=path)
    kind, label = raw.get("kind"), fqn
    crc_s = raw.get("crc32")
    if not (isinstance(crc_s, str) and len(crc_s) == 8 and all(c in "0123456789abcdef" for c in crc_s)):
        raise FormatError(f"'crc32' must be 8 lowercase hex digits, got {crc_s!r}", path=path, entry=label)
    offset = _int(raw.get("offset"), "'offset'", path, label, lo=PREAMBLE_SIZE)
    length = _int(raw.get("length"), "'length'", path, label)
    if kind == KIND_BYTES:
        return Entry(fqn, None, kind, None, (), offset, length, int(crc_s, 16))
    if kind == KIND_ENCODED:
        return _decode_encoded(raw, fqn, offset, length, int(crc_s, 16), path)
    if kind != KIND_TENSOR:
        raise FormatError(f"unknown entry kind {kind!r}", path=path, entry=label)
    chunk, shape, dtype, label = _chunk_fields(raw, fqn, path)
    numel, bad = math.prod(shape), shape_problem(shape)  # a zero-element shape can still overflow torch's strides
    if bad or numel * ITEMSIZES[dtype] != length:  # type: ignore[index]
        raise FormatError(bad or f"length {length} does not match shape {list(shape)} of {dtype} "
                          f"({numel * ITEMSIZES[dtype]} bytes)", path=path, entry=label)  # type: ignore[index]
    if offset % MIN_ALIGNMENT:
        raise EntryBoundsError(f"data offset {offset} is not a multiple of {MIN_ALIGNMENT}", path=path, entry=label)
    return Entry(fqn, chunk, kind, dtype, shape, offset, length, int(crc_s, 16))  # type: ignore[arg-type]


def _chunk_fields(raw: dict[str, Any], fqn: str, path: str) -> tuple[tuple[int, ...], tuple[int, ...], Any, str]:
    """A tensor chunk entry's chunk_offsets, shape and dtype name (checked), and its label."""
    chunk = _int_list(raw.get("chunk_offsets"), "'chunk_offsets'", path, fqn)
    label = f"{fqn}@{list(chunk)}"
    shape = _int_list(raw.get("shape"), "'shape'", path, label)
    if len(chunk) != len(shape):
        raise FormatError(f"chunk_offsets has {len(chunk)} dims but shape has {len(shape)}", path=path, entry=label)
    dtype = raw.get("dtype")
    check_dtype_name(dtype, path=path, entry=label)
    return chunk, shape, dtype, label


def _decode_encoded(raw: dict[str, Any], fqn: str, offset: int, length: int, crc: int, path: str) -> Entry:
    """A KIND_ENCODED entry: a tensor chunk (with chunk_offsets, dtype, shape) or a value, and its transforms."""
    ts = raw.get("transforms")
    if not (isinstance(ts, list) and 0 < len(ts) <= MAX_NDIM and all(isinstance(t, str) and len(t) <= 256 for t in ts)):
        raise FormatError(f"'transforms' must be a non-empty list of descriptor strings, got {ts!r}"[:300],
                          path=path, entry=fqn)
    if "chunk_offsets" not in raw:
        return Entry(fqn, None, KIND_ENCODED, None, (), offset, length, crc, tuple(ts))
    chunk, shape, dtype, _ = _chunk_fields(raw, fqn, path)
    return Entry(fqn, chunk, KIND_ENCODED, dtype, shape, offset, length, crc, tuple(ts))  # type: ignore[arg-type]


def decode_header_doc(body: bytes, *, header_crc: int, path: str) -> tuple[dict[str, Any], str | None]:
    """Check a JSON header's checksum and top level; return (the JSON document, its save id).

    Its entries are not checked: :func:`decode_header` does that. A reader that takes
    every entry's place from the checkpoint metadata needs only this much.
    """
    if crc32(body) != header_crc:
        raise FormatError("header checksum mismatch: the header is damaged", path=path)
    try:
        doc = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise FormatError(f"header is not valid JSON: {e}", path=path) from None
    if not isinstance(doc, dict) or doc.get("format") != "mmapckpt" or not isinstance(doc.get("entries"), list):
        raise FormatError("header is not an mmapckpt header object with an 'entries' list", path=path)
    save_id = doc.get("save_id")
    if save_id is not None and not (isinstance(save_id, str) and len(save_id) <= 256):
        raise FormatError(f"'save_id' must be a string of at most 256 characters, got {save_id!r}"[:300], path=path)
    return doc, save_id


def decode_header(body: bytes, *, header_crc: int, byte_order: int, minor: int, file_size: int, path: str,
                  doc: dict[str, Any] | None = None) -> ShardHeader:
    """Parse and validate a JSON header against the file's size.

    Every entry must lie after the header and inside the file, and no two may share a
    key or overlap (but as exact aliases), so that views built from them never touch bytes
    outside the file. ``doc``: the header already decoded by :func:`decode_header_doc`.
    """
    if doc is None:
        doc, _ = decode_header_doc(body, header_crc=header_crc, path=path)
    save_id = doc.get("save_id")
    data_start = PREAMBLE_SIZE + len(body)
    entries = tuple(_decode_entry(raw, path, i) for i, raw in enumerate(doc["entries"]))
    seen: set[tuple[str, tuple[int, ...] | None]] = set()
    prev_end, prev = data_start, None
    for e in sorted(entries, key=lambda e: (e.offset, e.length)):
        if e.key in seen:
            raise EntryBoundsError("duplicate entry", path=path, entry=e.label)
        seen.add(e.key)
        alias = prev is not None and e.kind == prev.kind == KIND_TENSOR and e.fqn != prev.fqn and (  # rule 6
            e.offset, e.length, e.dtype, e.shape, e.crc32) == (prev.offset, prev.length, prev.dtype, prev.shape,
                                                               prev.crc32)
        if e.offset < prev_end and e.length and not alias:
            what = "the header" if prev is None else f"entry {prev.label!r}"
            raise EntryBoundsError(f"data at offset {e.offset} overlaps {what}", path=path, entry=e.label)
        if e.offset + e.length > file_size:
            raise TruncatedFileError(
                f"data [{e.offset}, {e.offset + e.length}) runs past the end of the {file_size}-byte file",
                path=path, entry=e.label)
        if e.length:
            prev_end, prev = e.offset + e.length, e
    return ShardHeader(entries, data_start, byte_order, minor, save_id)


def __getattr__(name: str) -> Any:
    if name == "DTYPES":  # name -> (torch.dtype, itemsize): made (importing torch) on first use, format/dtypes.py
        from . import dtypes
        return dtypes.DTYPES
    raise AttributeError(name)
