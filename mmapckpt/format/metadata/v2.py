"""The entry table of a version-2 ``.metadata`` body: every entry and chunk as a few integers.

Version 1 described each entry as JSON objects (a state-dict item, its chunks, a storage
record): about 275 bytes and 10 microseconds of decoding an entry. Version 2 keeps the
same facts in flat arrays (docs/format.md, section 3.1)::

    "table": {"names": [...], "dtypes": [...], "files": [...], "rows": [int, ...],
              "transforms": {"<record number>": [descriptor, ...]}}

``rows`` holds, for each name in order, a bytes item as ``-1, file, file_offset, length,
index`` and a tensor as ``dtype, flags, ndim, size..., nchunks`` and per chunk ``file,
file_offset, length, index, whole`` followed, when ``whole`` is 0, by its ``offsets...``
and ``sizes...``. ``file`` -1 is a chunk with no storage record; ``index`` -1 is no
MetadataIndex hint; flag 1 is ``requires_grad``. Records are numbered in row order.
The decoder checks everything version 1's does, at a few microseconds an entry.
"""

from __future__ import annotations

from itertools import repeat
from typing import TYPE_CHECKING, Any

from ...errors import FormatError
from .. import layout as fmt
from ..entries import ChunkInfo, EntryInfo, safe_relative_path
from ..tiling import check_entries
from .index import InvalidMetadata, MetaIndex, top_fields
from .v2_columns import bulk_index

if TYPE_CHECKING:  # the encoder reads DCP objects a caller built, or written.py's; decoding needs none
    from torch.distributed.checkpoint.metadata import Metadata

    from .written import WrittenMetadata

__all__ = ["encode", "decode", "encode_table", "encode_planner_data", "planner_paths"]


def encode_table(md: Metadata | WrittenMetadata) -> dict[str, Any]:
    """The ``table`` of DCP ``Metadata`` whose storage_data values are ``_StorageInfo`` records, or of its
    shape in the format's own types (written.py): a tensor entry has ``chunks``, a payload has none."""
    recs = {(idx.fqn, None if idx.offset is None else tuple(idx.offset)): (idx.index, info)
            for idx, info in (md.storage_data or {}).items()}
    names, rows, transforms = [], [], {}
    dtypes: dict[str, int] = {}
    files: dict[str, int] = {}
    nrec = 0

    def record(key: Any) -> None:
        nonlocal nrec
        hint, info = recs.pop(key, (None, None))
        if info is None:
            rows.extend((-1, 0, 0, -1))
        else:
            rows.extend((files.setdefault(info.relative_path, len(files)), info.offset, info.length,
                         -1 if hint is None else hint))
            if getattr(info, "transform_descriptors", None):
                transforms[str(nrec)] = [str(d) for d in info.transform_descriptors]
        nrec += 1

    for fqn, item in md.state_dict_metadata.items():
        names.append(fqn)
        if getattr(item, "chunks", None) is None:  # DCP's BytesStorageMetadata (a payload)
            rows.append(-1)
            record((fqn, None))
            continue
        size = tuple(item.size)
        rows.extend((dtypes.setdefault(fmt.dtype_name(item.properties.dtype), len(dtypes)),
                     1 if item.properties.requires_grad else 0, len(size), *size, len(item.chunks)))
        for c in item.chunks:
            off, sz = tuple(c.offsets), tuple(c.sizes)
            record((fqn, off))
            if sz == size and not any(off):
                rows.append(1)
            else:
                rows.extend((0, *off, *sz))
    if recs:
        fqn, off = next(iter(recs))
        raise ValueError(f"storage record of {fqn!r}{'' if off is None else list(off)} matches no entry")
    return {"names": names, "dtypes": list(dtypes), "files": list(files), "rows": rows, "transforms": transforms}


def encode(md: Metadata | WrittenMetadata) -> dict[str, Any]:
    """The version-2 body's fields that describe the entries (in the body's key order)."""
    return {"planner_data": encode_planner_data(md), "table": encode_table(md)}


def encode_planner_data(md: Metadata | WrittenMetadata) -> Any:
    """DCP's ``planner_data`` ({fqn: path}) without the paths that follow from the name: null, or
    ``{"rule": "dots" | "whole", "paths": {fqn: path, ...}}`` holding only the others."""
    pd = md.planner_data
    if pd is None:
        return None
    if not isinstance(pd, dict):
        raise TypeError(f"planner_data must be a dict of paths, got {type(pd).__name__}")
    for k, v in pd.items():
        if not isinstance(k, str) or not all(type(x) in (str, int) for x in v):
            raise TypeError(f"planner_data path of {k!r} must hold only strings and integers, got {v!r}")
    whole = sum(1 for k, v in pd.items() if len(v) == 1 and v[0] == k)
    if whole == len(pd):  # the usual flat dict: only names without a dot are also their dotted path
        dots = sum(1 for k in pd if "." not in k)
    else:
        dots = sum(1 for k, v in pd.items() if tuple(v) == tuple(k.split(".")))
    rule = "dots" if dots >= whole else "whole"
    implied = (lambda k: tuple(k.split("."))) if rule == "dots" else (lambda k: (k,))
    return {"rule": rule, "names": [k for k in pd if k not in md.state_dict_metadata],
            "paths": {k: list(v) for k, v in pd.items() if tuple(v) != implied(k)}}


def planner_paths(raw: Any, names: Any) -> dict[str, tuple[Any, ...]] | None:
    """Expand :func:`encode_planner_data`'s form for the entry ``names``."""
    if raw is None:
        return None
    if type(raw) is not dict or raw.get("rule") not in ("dots", "whole") or type(raw.get("paths")) is not dict \
            or type(raw.get("names", [])) is not list:
        raise InvalidMetadata("'planner_data' must be null or an object with 'rule' and 'paths'")
    paths = raw["paths"]
    for v in paths.values():
        if type(v) is not list or not all(type(p) in (str, int) for p in v):
            raise InvalidMetadata("planner_data paths must be lists of strings and integers")
    keys = [*names, *raw.get("names", [])]
    if not set(map(type, keys)) <= {str}:
        raise InvalidMetadata("planner_data names must be strings")
    # every name's implied path at C speed, then the few stored ones in their places
    implied = map(tuple, map(str.split, keys, repeat("."))) if raw["rule"] == "dots" else zip(keys)
    out: dict[str, tuple[Any, ...]] = dict(zip(keys, implied))
    for k, p in paths.items():
        if k in out:
            out[k] = tuple(p)
    return out


def _ints(rows: Any) -> list[int]:
    if type(rows) is not list:
        raise InvalidMetadata("'rows' must be a list of integers")
    if not set(map(type, rows)) <= {int}:  # bool is an int subclass: refused too
        raise InvalidMetadata("'rows' must be a list of integers")
    if rows and (min(rows) < -1 or max(rows) > fmt.MAX_INT):
        raise InvalidMetadata("'rows' values must lie in [-1, 2**63)")
    return rows


def _strings(v: Any, what: str) -> list[str]:
    if type(v) is not list or not set(map(type, v)) <= {str}:
        raise InvalidMetadata(f"'{what}' must be a list of strings")
    return v


def _transforms(raw: Any) -> dict[int, tuple[str, ...]]:
    if type(raw) is not dict:
        raise InvalidMetadata("'transforms' must be an object")
    out = {}
    for k, v in raw.items():
        if not k.isdigit() or type(v) is not list or not 0 < len(v) <= 64 \
                or not all(type(t) is str and len(t) <= 256 for t in v):
            raise InvalidMetadata("'transforms' must map record numbers to lists of descriptors")
        out[int(k)] = tuple(v)
    return out


def decode(doc: Any, path: str, *, ints_only: bool = False, entries_only: bool = False) -> MetaIndex:
    """Validate a version-2 body into the index of entries: the one decoder of version 2.

    The table's header (names, files, dtypes) is checked here. A table of the common shape
    (every tensor one whole chunk, no stream transforms) is then read column by column
    (v2_columns.py), which takes it only if every value is sound; any other table, and every
    table with a defect, is read entry by entry (:func:`_walk`), which names the defect. Both
    end in the rules of ``tiling.check_entries`` (the columns in their column form).

    ``ints_only``: the parse found only integers and no ``true`` or ``false`` in the document,
    so the rows need no look at their types here. ``entries_only``: the index's
    ``requires_grad`` and ``record_index`` may be left empty and its entries built on first use
    (what ``read_index_file`` returns needs neither). Its ``doc`` keeps the body's small
    top-level fields, ``planner_data`` in its compact form (:func:`planner_paths` expands it).
    """
    if type(doc) is not dict:
        raise InvalidMetadata("metadata must be a JSON object")
    save_id, top = top_fields(doc)
    table = doc.get("table")
    if type(table) is not dict:
        raise InvalidMetadata("'table' must be an object")
    names = _strings(table.get("names"), "names")
    refs = getattr(save_id, "references", None)
    files = [safe_relative_path(f, path, refs) for f in _strings(table.get("files"), "files")]
    dtypes = []
    for n in _strings(table.get("dtypes"), "dtypes"):
        dtypes.append(fmt.NAMED[n] if n in fmt.NAMED else fmt.dtype_from_name(n, path=path))  # raises if unknown
    name_set = frozenset(names)
    if len(name_set) != len(names):
        raise InvalidMetadata("the table names an entry twice")
    rows, tf_raw = table.get("rows"), table.get("transforms", {})
    if not ints_only:  # the parse could not tell (a float, true or false somewhere): look at the rows
        rows = _ints(rows)
    if tf_raw == {}:
        bulk = bulk_index(names, name_set, files, dtypes, rows, entries_only)
        if bulk is not None:
            return MetaIndex(bulk[0], save_id, top, bulk[1], bulk[2], {})  # type: ignore[arg-type]
    if ints_only:
        rows = _ints(rows)
    tf = _transforms(tf_raw)
    try:
        return _walk(names, files, dtypes, rows, tf, path, top, save_id)
    except FormatError:
        raise
    except (IndexError, ValueError):  # rows cut short: an index past the end, or too few values to unpack
        raise InvalidMetadata("'rows' ends before every entry is described") from None


def _walk(names: list[str], files: list[str], dtypes: list[Any], rows: list[int], tf: dict[int, tuple[str, ...]],
          path: str, top: dict[str, Any], save_id: str | None) -> MetaIndex:
    """The table read entry by entry: any shape, every defect named (rows of integers in [-1, 2**63))."""
    entries: dict[str, EntryInfo] = {}
    grad: set[str] = set()
    hints: dict[Any, int] = {}
    transforms: dict[Any, tuple[str, ...]] = {}
    zeros: dict[int, tuple[int, ...]] = {}
    missing: list[str] = []
    nfiles, ndt = len(files), len(dtypes)
    p = nrec = 0
    for name in names:
        code = rows[p]
        nd = rows[p + 2] if code >= 0 else -1
        if code < ndt and 0 <= nd <= 64:
            # the common case first: a tensor in one whole chunk, in a file of the table, at its own length
            q = p + 3 + nd
            if rows[q] == 1 and rows[q + 5] == 1 and rows[q + 1] >= 0 and rows[p + 1] in (0, 1):
                size = tuple(rows[p + 3:q])
                f, off, ln, hint = rows[q + 1:q + 5]
                dtype, itemsize = dtypes[code]
                n = itemsize
                for x in size:
                    n *= x
                if (f < nfiles and off >= 0 and ln == n and len(size) == nd and (not size or min(size) >= 0)
                        and nrec not in tf):
                    z = zeros.get(nd)
                    if z is None:
                        z = zeros[nd] = (0,) * nd
                    entries[name] = EntryInfo(name, "tensor", dtype, size, (ChunkInfo(z, size, files[f], off, ln),))
                    if hint >= 0:
                        hints[(name, z)] = hint
                    if rows[p + 1]:
                        grad.add(name)
                    p = q + 6
                    nrec += 1
                    continue
        if code < 0:  # a bytes item: one record
            f, off, ln, hint = rows[p + 1:p + 5]
            p += 5
            if off < 0 or ln < 0:
                raise InvalidMetadata(f"a record of {name!r} has a negative offset or length")
            if hint >= 0:
                hints[(name, None)] = hint
            if nrec in tf:
                transforms[(name, None)] = tf[nrec]
            nrec += 1
            if f < 0:
                missing.append(name)
                continue
            if f >= nfiles:
                raise InvalidMetadata(f"a record of {name!r} names no file of the table")
            entries[name] = EntryInfo(name, "object", None, None, (ChunkInfo((), (), files[f], off, ln),))
            continue
        if code >= ndt:
            raise InvalidMetadata(f"{name!r} names no dtype of the table")
        dtype, itemsize = dtypes[code]
        flags, nd = rows[p + 1], rows[p + 2]
        if flags not in (0, 1) or not 0 <= nd <= fmt.MAX_NDIM:
            raise InvalidMetadata(f"{name!r} has bad flags or more than {fmt.MAX_NDIM} dims")
        size = tuple(rows[p + 3:p + 3 + nd])
        nc = rows[p + 3 + nd]
        p += 4 + nd
        if len(size) != nd or not 0 <= nc <= 1 << 24 or min(size, default=0) < 0:
            raise InvalidMetadata(f"{name!r} is cut short or has too many chunks")
        chunks, whole_n = [], 1
        for s in size:
            whole_n *= s
        z = zeros.get(nd)
        if z is None:
            z = zeros[nd] = (0,) * nd
        for _ in range(nc):
            f, off, ln, hint, whole = rows[p:p + 5]
            p += 5
            if off < 0 or ln < 0:
                raise InvalidMetadata(f"a chunk of {name!r} has a negative offset or length")
            if whole == 1:
                o, sz, n = z, size, whole_n
            elif whole == 0:
                o, sz = tuple(rows[p:p + nd]), tuple(rows[p + nd:p + 2 * nd])
                p += 2 * nd
                if len(sz) != nd or min(o + sz, default=0) < 0:
                    raise InvalidMetadata(f"a chunk of {name!r} is cut short")
                n = 1
                for a, b, g in zip(o, sz, size):
                    if a + b > g:
                        raise InvalidMetadata(f"a chunk of {name!r} lies outside the tensor")
                    n *= b
            else:
                raise InvalidMetadata(f"a chunk of {name!r} has a bad 'whole' flag")
            if hint >= 0:
                hints[(name, o)] = hint
            enc = tf.get(nrec)
            nrec += 1
            if enc is not None:
                transforms[(name, o)] = enc
            if f < 0:
                missing.append(f"{name}@{list(o)}")
                continue
            if f >= nfiles:
                raise InvalidMetadata(f"a chunk of {name!r} names no file of the table")
            if ln != n * itemsize and enc is None:
                raise InvalidMetadata(f"storage record of {name!r}@{list(o)} is {ln} bytes, its chunk holds "
                                      f"{n * itemsize}")
            chunks.append(ChunkInfo(o, sz, files[f], off, ln))
        entries[name] = EntryInfo(name, "tensor", dtype, size, tuple(chunks))
        if flags:
            grad.add(name)
    if p != len(rows):
        raise InvalidMetadata("'rows' holds more than the entries it describes")
    if missing:
        raise FormatError("metadata has no storage record for this entry", path=path, entry=missing[0])
    check_entries(entries.values(), path)  # shapes torch can make, exact tiling, no aliasing but tied weights
    return MetaIndex(entries, save_id, top, grad, hints, transforms)
