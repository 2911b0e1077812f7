"""How the version-2 decoder (v2.py) reads a table of the common shape: column by column, in C loops.

The table's common shape (every tensor stored as one whole chunk, no stream transforms,
every value sound) is what ``mmapckpt.save`` and a single-process ``dcp.save`` write. For
it, the per-entry Python loop of ``v2._walk`` (about 3 microseconds an entry) is
replaced by one short loop that finds where each entry's values start, then by ``map``,
``zip``, ``set``, ``min`` and ``max`` over whole columns of ``rows``, which run in C.

The contract with ``v2.decode``, its one caller: :func:`bulk_index` returns what
``v2._walk`` returns for the same table, or None, and it returns None whenever ``_walk``
would refuse the table (or whenever the table is of another shape). ``v2.decode`` then
runs ``_walk``, which names the defect. Nothing is refused here, so every message is
``_walk``'s (or, for the header checked before either runs, ``v2.decode``'s).
"""

from __future__ import annotations

import threading
from collections.abc import ItemsView, Iterator, Mapping, ValuesView
from functools import partial
from itertools import chain, compress, repeat
from operator import add, itemgetter, mul
from typing import Any

import numpy as np

from .. import layout as fmt
from ..entries import ChunkInfo, EntryInfo, paused_gc
from ..tiling import shape_fits

__all__ = ["bulk_index", "TableEntries"]

_ZEROS = tuple((0,) * n for n in range(fmt.MAX_NDIM + 1))  # a chunk's offsets by rank; an index past 64 fails
_NDIMS = frozenset(range(fmt.MAX_NDIM + 1))
_FLAGS = frozenset((0, 1))
#: the named tuples built as tuple.__new__(cls, values): what their _make does, without a Python frame each
_chunk = partial(tuple.__new__, ChunkInfo)
_entry = partial(tuple.__new__, EntryInfo)
Bulk = tuple[Mapping[str, EntryInfo], set[str], dict[Any, int]]


def bulk_index(names: list[str], name_set: frozenset[str], files: list[str], dtypes: list[Any], rows: Any,
               entries_only: bool = False) -> Bulk | None:
    """(entries, requires_grad names, MetadataIndex hints) of a table of the common shape, or None.

    The caller (``v2.decode``) has checked the names (``name_set``: each once), files and dtypes,
    and that the rows hold no value of another type than ``int`` (a set or a sum of values
    cannot tell ``True`` or ``1.0`` from ``1``; strings, nulls, lists and objects are refused
    here). ``entries_only``: the entries are a :class:`TableEntries`, built on first use, and the
    requires_grad names and hints are left empty (a reader of entries needs neither).
    """
    if type(rows) is not list or not names:
        return None
    try:
        checked = _check(names, files, dtypes, rows)
    except (IndexError, TypeError):
        # cut short, or a string, null, list or object where an integer belongs: an index or a
        # comparison with an integer fails on it, or a set of integers does not hold it
        return None
    if checked is None:
        return None
    starts, codes = checked
    if entries_only:
        return TableEntries(names, name_set, starts, codes, rows, files, dtypes), set(), {}
    return _build(names, starts, codes, rows, files, dtypes, True)


def _starts(names: list[str], rows: list[int]) -> list[int] | None:
    """Where each entry's values start in ``rows``; None for an entry of another shape, or rows of another length.

    Only positions are found here: a value that is out of range moves them somewhere wrong,
    and the column checks of :func:`_check` then refuse the table.
    """
    starts: list[int] = []
    add_start = starts.append
    p = 0
    for _ in names:
        add_start(p)
        if rows[p] < 0:  # a bytes item: code, file, file_offset, length, index
            p += 5
            continue
        q = p + 3 + rows[p + 2]  # past dtype, flags, ndim and the size
        if rows[q] != 1 or rows[q + 5] != 1:  # not one chunk, or not the whole tensor
            return None
        p = q + 6
    return starts if p == len(rows) else None


def _col(rows: list[Any], at: list[int], shift: int) -> list[Any]:
    """``rows[i + shift]`` for each ``i`` of ``at``."""
    if len(at) < 2:  # itemgetter of one index returns the value, not a tuple
        return [rows[i + shift] for i in at]
    return list(itemgetter(*map(add, at, repeat(shift)))(rows))


def _within(col: list[int] | set[int], lo: int) -> bool:
    return not col or (min(col) >= lo and max(col) <= fmt.MAX_INT)


def _sizes(rows: list[Any], at: list[int], nds: list[int]) -> list[tuple[int, ...]]:
    """Each tensor's size: for the tensors of each rank, ``zip`` of one column a dimension."""
    ranks = set(nds)
    by_rank = {}
    for nd in ranks:
        at_nd = at if len(ranks) == 1 else list(compress(at, map(nd.__eq__, nds)))
        by_rank[nd] = list(zip(*(_col(rows, at_nd, 3 + k) for k in range(nd)))) if nd else [()] * len(at_nd)
    if len(ranks) == 1:
        return by_rank[nds[0]] if nds else []
    its = {nd: iter(v) for nd, v in by_rank.items()}
    return list(map(next, map(its.__getitem__, nds)))  # back in the table's order


def _check(names: list[str], files: list[str], dtypes: list[Any],
           rows: list[Any]) -> tuple[list[int], list[int]] | None:
    """(where each entry starts, each entry's dtype code) if every value is sound, else None."""
    starts = _starts(names, rows)
    if starts is None:
        return None
    codes = _col(rows, starts, 0)
    in_files = frozenset(range(len(files)))
    if not set(codes) <= frozenset(range(-1, len(dtypes))):
        return None
    at = starts
    records: list[tuple[list[int], list[int], list[int]]] = []  # (files, offsets, lengths) of each group
    if min(codes) < 0:  # bytes items among the tensors: their file, file_offset, length and index
        is_bytes = list(map((-1).__eq__, codes))
        b = list(compress(starts, is_bytes))
        fs, offs, lns = (_col(rows, b, k) for k in (1, 2, 3))
        if not (set(fs) <= in_files and _within(offs, 0) and _within(lns, 0) and _within(_col(rows, b, 4), -1)):
            return None
        records.append((fs, offs, lns))
        at = list(compress(starts, map((-1).__lt__, codes)))
    nds = _col(rows, at, 2)
    if not set(nds) <= _NDIMS:
        return None
    itemsizes = [t[1] for t in dtypes]
    for nd in set(nds):
        if not _rank_sound(_rank_rows(rows, at, nds, nd, at is starts), nd, in_files, itemsizes, records):
            return None
    if not _disjoint(records, rows, starts, codes):
        return None
    return starts, codes


def _disjoint(records: list[tuple[list[int], list[int], list[int]]], rows: list[Any], starts: list[int],
              codes: list[int]) -> bool:
    """Whether no two records share bytes but as tied weights (format/tiling.py's rule), as columns:
    sorted by file and offset, each record must end where the next begins, or be the same range
    as the next, both of tensors of one dtype and shape (here every tensor is one whole chunk)."""
    def column(k: int, dtype: Any) -> Any:
        return np.fromiter(chain.from_iterable(r[k] for r in records), dtype=dtype)

    lns = column(2, np.uint64)
    fs, offs = column(0, np.int64), column(1, np.uint64)
    if len(fs) > 1 and not ((fs[1:] == fs[:-1]) & (offs[1:] >= offs[:-1]) | (fs[1:] > fs[:-1])).all():
        order = np.lexsort((offs, fs))  # a table's own order is usually already this one
        fs, offs, lns = fs[order], offs[order], lns[order]
    live = lns > 0  # empty records hold no bytes
    fs, offs, stop = fs[live], offs[live], offs[live] + lns[live]  # offset and length < 2**63: no wrap
    clash = (fs[1:] == fs[:-1]) & (offs[1:] < stop[:-1])
    if not clash.any():
        return True
    if (clash & ~((offs[1:] == offs[:-1]) & (stop[1:] == stop[:-1]))).any():
        return False
    return _tied(rows, starts, codes, {(int(fs[k]), int(offs[k])) for k in np.flatnonzero(clash).tolist()})


def _tied(rows: list[Any], starts: list[int], codes: list[int], shared: set[tuple[int, int]]) -> bool:
    """Whether the records at ``shared`` places are all tensors' and each place's tensors have one
    dtype and shape (tied weights); a walk over every entry, taken only when a table has such places."""
    seen: dict[tuple[int, int], list[Any]] = {}
    for p, code in zip(starts, codes):
        q = p + 1 if code < 0 else p + 4 + rows[p + 2]
        key = (rows[q], rows[q + 1])
        if key in shared and rows[q + 2]:
            seen.setdefault(key, []).append(None if code < 0 else rows[p:p + 1] + rows[p + 2:p + 3 + rows[p + 2]])
    return all(None not in v and all(x == v[0] for x in v) for v in seen.values())


def _rank_rows(rows: list[Any], at: list[int], nds: list[int], nd: int, all_tensors: bool) -> list[Any]:
    """The values of the tensors of rank ``nd``, one after another: ``9 + nd`` each."""
    if all_tensors and nds.count(nd) == len(nds):
        return rows  # every entry a tensor of this rank: the rows are just that
    at_nd = list(compress(at, map(nd.__eq__, nds)))
    return list(chain.from_iterable(map(rows.__getitem__, map(slice, at_nd, map(add, at_nd, repeat(9 + nd))))))


def _rank_sound(flat: list[Any], nd: int, in_files: frozenset[int], itemsizes: list[int],
                records: list[tuple[list[int], list[int], list[int]]]) -> bool:
    """Whether the tensors of one rank (``flat``: their values, ``9 + nd`` each) are sound.

    Each field is then a column ``flat[k::9 + nd]``, a slice made in C; the dtype codes and
    ranks are already known to be in range, and the chunk count and whole flag to be 1.
    """
    step = 9 + nd
    n = list(map(itemsizes.__getitem__, flat[0::step]))
    if not set(flat[1::step]) <= _FLAGS:
        return False
    sizes = [flat[3 + k::step] for k in range(nd)]
    for size in sizes:
        if not _within(size, 0):
            return False
        n = list(map(mul, n, size))
    lns = flat[6 + nd::step]
    if lns != n or (n and max(n) > fmt.MAX_INT):  # each record's length is its byte count (n >= 0)
        return False
    if 0 in n:  # a zero-element tensor's other dimensions can still overflow torch's strides
        if not all(shape_fits([s[i] for s in sizes]) for i in compress(range(len(n)), map((0).__eq__, n))):
            return False
    fs, offs = flat[4 + nd::step], flat[5 + nd::step]
    records.append((fs, offs, lns))
    return set(fs) <= in_files and _within(offs, 0) and _within(set(flat[7 + nd::step]), -1)


def _build(names: list[str], starts: list[int], codes: list[int], rows: list[Any], files: list[str],
           dtypes: list[Any], dcp: bool) -> Bulk:
    """The entries of a checked table, in its order; with ``dcp`` also the requires_grad names and hints."""
    hints = []
    if min(codes) >= 0:
        tnames, at, tcodes = names, starts, codes
        objs: list[EntryInfo] = []
    else:
        is_tensor, is_bytes = list(map((-1).__lt__, codes)), list(map((-1).__eq__, codes))
        tnames, at, tcodes = (list(compress(v, is_tensor)) for v in (names, starts, codes))
        bnames, b = list(compress(names, is_bytes)), list(compress(starts, is_bytes))
        fs, offs, lns, bh = (_col(rows, b, k) for k in (1, 2, 3, 4))
        chunks = map(_chunk, zip(repeat(()), repeat(()), map(files.__getitem__, fs), offs, lns))
        objs = list(map(_entry, zip(bnames, repeat("object"), repeat(None), repeat(None), zip(chunks))))
        if dcp:
            hints.extend(compress(zip(zip(bnames, repeat(None)), bh), map((-1).__lt__, bh)))
    nds = _col(rows, at, 2)
    ends = list(map(add, at, nds))
    sizes = _sizes(rows, at, nds)
    zeros = list(map(_ZEROS.__getitem__, nds))
    fs, offs, lns, th = (_col(rows, ends, k) for k in (4, 5, 6, 7))
    dts = [t[0] for t in dtypes]
    chunks = map(_chunk, zip(zeros, sizes, map(files.__getitem__, fs), offs, lns))
    tensors = map(_entry, zip(tnames, repeat("tensor"), map(dts.__getitem__, tcodes), sizes, zip(chunks)))
    if objs:
        picks = (iter(objs), tensors)
        entries = dict(zip(names, map(next, map(picks.__getitem__, map((-1).__lt__, codes)))))
    else:
        entries = dict(zip(names, tensors))
    if not dcp:
        return entries, set(), {}
    hints.extend(compress(zip(zip(tnames, zeros), th), map((-1).__lt__, th)))
    return entries, set(compress(tnames, _col(rows, at, 1))), dict(hints)


class TableEntries(Mapping[str, EntryInfo]):
    """The entries of a checked table by name, built all at once when the first one is asked for.

    Names, their number and membership are answered from the table's names alone (what
    ``open(...).keys()`` needs); every value was checked before this was made, so building
    raises nothing.
    """

    __slots__ = ("_names", "_set", "_table", "_built", "_lock")

    def __init__(self, names: list[str], name_set: frozenset[str], starts: list[int], codes: list[int],
                 rows: list[Any], files: list[str], dtypes: list[Any]) -> None:
        self._names, self._set = names, name_set
        self._table: tuple[Any, ...] | None = (starts, codes, rows, files, dtypes)
        self._built: dict[str, EntryInfo] | None = None
        self._lock = threading.Lock()  # get_tensor may be called from several threads at once

    def _all(self) -> dict[str, EntryInfo]:
        built = self._built
        if built is None:
            with self._lock:
                if self._built is None:
                    with paused_gc():  # the decoder's pause is over by now
                        self._built = _build(self._names, *self._table, False)[0]  # type: ignore[misc]
                    self._table = None  # the document's integers are no longer needed
                built = self._built
        return built

    def __getitem__(self, name: str) -> EntryInfo:
        return self._all()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __contains__(self, name: object) -> bool:
        return name in self._set

    def values(self) -> ValuesView[EntryInfo]:
        return self._all().values()

    def items(self) -> ItemsView[str, EntryInfo]:
        return self._all().items()

    def __reduce__(self) -> tuple[Any, ...]:
        return dict, (self._all(),)  # pickled and copied as the plain dict it stands for (a lock does neither)

    def __repr__(self) -> str:
        return f"TableEntries({len(self._names)} entries)"
