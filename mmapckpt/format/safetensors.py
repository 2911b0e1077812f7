"""safetensors files: the header parsed and checked (reading/safetensors_files.py opens the files).

The format (https://github.com/huggingface/safetensors) is::

    offset 0   n        u64, little-endian: the header's length in bytes
    offset 8   header   n bytes of UTF-8 JSON: {name: {"dtype", "shape", "data_offsets": [begin, end]},
                        optional "__metadata__": {str: str}}, often padded with spaces
    offset 8+n data     the tensors' bytes; data_offsets are relative to this point

This is the one parser of that header in the package (the lazy loader, ``convert``,
``inspect`` and ``verify`` all use it). It treats the file as hostile: the header is at
most ``MAX_HEADER_SIZE`` bytes and must be a JSON object without duplicate keys; every
dtype must be in :data:`SAFETENSORS_DTYPES`; every shape a list of non-negative ints
whose byte size is the entry's ``end - begin``; and, as ``safe_open`` demands, the
entries must tile the data section exactly (sorted by offset, each starting where the
previous one ends, the last ending at the end of the file: no overlap, no hole, nothing
past the end). A file ``safe_open`` refuses is refused here too, with a ``FormatError``
naming the file and the entry.

Alignment: a tensor is returned as a view over the mapping when its file offset is a
multiple of its element size (``save_file`` pads the header to 8 bytes and orders the
tensors by element size, so that is every tensor it writes); otherwise its bytes are
copied into a new, aligned tensor, because torch cannot view misaligned elements.
"""

from __future__ import annotations

import json
from typing import Any

from ..errors import FormatError, TruncatedFileError, UnknownDtypeError
from ..records import Record
from .dtypes import ITEMSIZES, torch_dtype
from .entries import ChunkInfo, EntryInfo, numel
from .tiling import shape_problem

__all__ = [
    "MAX_HEADER_SIZE",
    "SAFETENSORS_DTYPES",
    "SAFETENSORS_NAMES",
    "SafetensorsEntry",
    "SafetensorsHeader",
    "entry_infos",
    "looks_like_safetensors",
    "length_prefix",
    "parse_header",
]

#: The largest header accepted (safetensors' own limit).
MAX_HEADER_SIZE = 100_000_000
METADATA_KEY = "__metadata__"

#: safetensors dtype codes -> the format's dtype names (format/dtypes.py), written out by hand (the safetensors
#: spec's names).
SAFETENSORS_NAMES: dict[str, str] = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8",
    "U64": "uint64", "U32": "uint32", "U16": "uint16", "U8": "uint8",
    "BOOL": "bool", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "C64": "complex64",
}


SAFETENSORS_DTYPES: dict[str, Any]  # codes -> torch dtypes, made on first use: see __getattr__


def __getattr__(name: str) -> Any:
    """``SAFETENSORS_DTYPES``: codes -> torch dtypes, made (importing torch) on first use."""
    if name == "SAFETENSORS_DTYPES":
        table = {code: torch_dtype(n) for code, n in SAFETENSORS_NAMES.items()}
        globals()[name] = table
        return table
    raise AttributeError(name)


class SafetensorsEntry(Record):
    """One tensor of a safetensors header; ``begin``/``end`` are relative to the data section; ``dtype_name``: the
    format's name of its dtype (:attr:`dtype`: the torch dtype)."""

    __slots__ = ()

    name: str
    dtype_name: str
    shape: tuple[int, ...]
    begin: int
    end: int

    def __new__(cls, name: str, dtype_name: str, shape: tuple[int, ...], begin: int, end: int) -> SafetensorsEntry:
        return tuple.__new__(cls, (name, dtype_name, shape, begin, end))

    @property
    def dtype(self) -> Any:
        return torch_dtype(self.dtype_name)


class SafetensorsHeader(Record):
    """A checked header: the entries in the header's order, the user metadata, where the data starts."""

    __slots__ = ()

    path: str
    entries: dict[str, SafetensorsEntry]
    metadata: dict[str, str] | None
    data_start: int
    file_size: int

    def __new__(cls, path: str, entries: dict[str, SafetensorsEntry], metadata: dict[str, str] | None,
                data_start: int, file_size: int) -> SafetensorsHeader:
        return tuple.__new__(cls, (path, entries, metadata, data_start, file_size))


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise _Duplicate(k)
        out[k] = v
    return out


class _Duplicate(Exception):
    pass


def _is_int(v: Any) -> bool:
    return type(v) is int and v >= 0


def _entry(name: str, doc: Any, data_size: int, path: str) -> SafetensorsEntry:
    if type(doc) is not dict:
        raise FormatError("header entry is not a JSON object", path=path, entry=name)
    code, shape, offsets = doc.get("dtype"), doc.get("shape"), doc.get("data_offsets")
    if type(code) is not str:
        raise FormatError("header entry has no 'dtype' string", path=path, entry=name)
    dtype = SAFETENSORS_NAMES.get(code)
    if dtype is None:
        raise UnknownDtypeError(f"safetensors dtype {code!r} is not supported (known: "
                                f"{', '.join(SAFETENSORS_NAMES)})", path=path, entry=name)
    if type(shape) is not list or not all(_is_int(s) for s in shape):
        raise FormatError(f"'shape' must be a list of non-negative integers, not {shape!r:.80}", path=path, entry=name)
    bad = shape_problem(shape)  # e.g. [0, 2**63]: no elements, but no tensor torch can make either
    if bad is not None:
        raise FormatError(bad, path=path, entry=name)
    if type(offsets) is not list or len(offsets) != 2 or not all(_is_int(o) for o in offsets):
        raise FormatError(f"'data_offsets' must be [begin, end] (non-negative integers), not {offsets!r:.80}",
                          path=path, entry=name)
    begin, end = offsets
    if begin > end:
        raise FormatError(f"data_offsets [{begin}, {end}] end before they begin", path=path, entry=name)
    if end > data_size:
        raise TruncatedFileError(f"data_offsets [{begin}, {end}] run past the end of the {data_size}-byte data "
                                 "section", path=path, entry=name)
    want = numel(tuple(shape)) * ITEMSIZES[dtype]
    if end - begin != want:
        raise FormatError(f"{code} {shape} takes {want} bytes but data_offsets [{begin}, {end}] hold {end - begin}",
                          path=path, entry=name)
    return SafetensorsEntry(name, dtype, tuple(shape), begin, end)


def _user_metadata(doc: Any, path: str) -> dict[str, str] | None:
    if doc is None:
        return None
    if type(doc) is not dict or not all(type(v) is str for v in doc.values()):
        raise FormatError(f"{METADATA_KEY!r} must be an object of strings", path=path, entry=METADATA_KEY)
    return doc


def _check_tiling(entries: dict[str, SafetensorsEntry], data_size: int, path: str) -> None:
    """The entries must tile the data section, as safe_open demands: no overlap, no hole, no tail."""
    at, last = 0, None
    for e in sorted(entries.values(), key=lambda e: (e.begin, e.end)):
        if e.begin != at:
            what = "overlaps" if e.begin < at else "leaves a gap after"
            prev = f"entry {last!r}" if last is not None else "the start of the data"
            raise FormatError(f"data_offsets [{e.begin}, {e.end}] {what} {prev} (ending at {at}): safetensors "
                              "data must be tiled by the entries", path=path, entry=e.name)
        at, last = e.end, e.name
    if at != data_size:
        raise FormatError(f"the entries cover {at} of the {data_size} bytes after the header: the file has "
                          "bytes no entry describes (damaged or not written by safetensors)", path=path)


def parse_header(raw: bytes, file_size: int, path: str) -> SafetensorsHeader:
    """Check a safetensors header (``raw``: the whole header, after the 8-byte length) against a file of
    ``file_size`` bytes; every defect raises FormatError naming ``path`` and the entry."""
    data_start = 8 + len(raw)
    try:
        text = raw.decode("utf-8")
        doc = json.loads(text, object_pairs_hook=_no_duplicates)
    except _Duplicate as d:
        raise FormatError("the header names this entry twice", path=path, entry=str(d)) from None
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise FormatError(f"safetensors header is not valid JSON: {e}", path=path) from None
    if type(doc) is not dict:
        raise FormatError("safetensors header is not a JSON object", path=path)
    data_size = file_size - data_start
    metadata = _user_metadata(doc.pop(METADATA_KEY, None), path)
    entries = {name: _entry(name, d, data_size, path) for name, d in doc.items()}
    _check_tiling(entries, data_size, path)
    return SafetensorsHeader(path, entries, metadata, data_start, file_size)


def length_prefix(head: bytes, file_size: int) -> int | None:
    """The header length a file's first 9 bytes announce, where they look like a safetensors file's
    (a plausible length, then ``{``); else None."""
    if len(head) < 9:
        return None
    n = int.from_bytes(head[:8], "little")
    return n if head[8:9] == b"{" and 2 <= n <= min(MAX_HEADER_SIZE, file_size - 8) else None


def looks_like_safetensors(head: bytes, file_size: int) -> bool:
    """Whether a file's first 9 bytes (of ``file_size``) start like a safetensors file."""
    return length_prefix(head, file_size) is not None


def entry_infos(header: SafetensorsHeader, rel: str, names: list[str] | None = None) -> dict[str, EntryInfo]:
    """The index entries (one whole-tensor chunk each) of ``names`` (default: all) of a file named ``rel``."""
    out = {}
    for name in header.entries if names is None else names:
        e = header.entries.get(name)
        if e is None:
            raise FormatError("the index names this tensor for this file, but its header lacks it", path=header.path,
                              entry=name)
        c = ChunkInfo((0,) * len(e.shape), e.shape, rel, header.data_start + e.begin, e.end - e.begin)
        out[name] = EntryInfo(name, "tensor", e.dtype_name, e.shape, (c,))
    return out
