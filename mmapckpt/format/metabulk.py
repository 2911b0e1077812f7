"""The version-2 entry table checked and decoded column by column, at the speed of C loops.

The table's common shape (every tensor stored as one whole chunk, no stream transforms,
every value sound) is what ``mmapckpt.save`` and a single-process ``dcp.save`` write. For
it, the per-entry Python loop of ``metatable._walk`` (about 3 microseconds an entry) is
replaced by one short loop that finds where each entry's values start, then by ``map``,
``zip``, ``set``, ``min`` and ``max`` over whole columns of ``rows``, which run in C.

The contract: :func:`bulk_index` returns what ``metatable._walk`` returns for the same
table, or None, and it returns None whenever ``_walk`` would refuse the table (or whenever
the table is of another shape). The caller then runs ``_walk``, which names the defect.
Nothing is refused here, so every message stays ``_walk``'s.
"""

from __future__ import annotations

import threading
from collections.abc import ItemsView, Iterator, Mapping, ValuesView
from functools import partial
from itertools import chain, compress, repeat
from math import prod
from operator import add, itemgetter, mul
from typing import Any

from . import layout as fmt
from .entries import ChunkInfo, EntryInfo, paused_gc

__all__ = ["bulk_index", "TableEntries"]

_ZEROS = tuple((0,) * n for n in range(fmt.MAX_NDIM + 1))  # a chunk's offsets by rank; an index past 64 fails
_NDIMS = frozenset(range(fmt.MAX_NDIM + 1))
_FLAGS = frozenset((0, 1))
#: the named tuples built as tuple.__new__(cls, values): what their _make does, without a Python frame each
_chunk = partial(tuple.__new__, ChunkInfo)
_entry = partial(tuple.__new__, EntryInfo)
Bulk = tuple[Mapping[str, EntryInfo], set[str], dict[Any, int]]


def bulk_index(names: list[str], files: list[str], dtypes: list[Any], rows: Any, tf_raw: Any,
               ints_only: bool, entries_only: bool = False) -> Bulk | None:
    """(entries, requires_grad names, MetadataIndex hints) of a table of the common shape, or None.

    ``ints_only``: the caller knows every number of the document is an integer and that it
    holds no ``true``/``false`` (json.loads' hooks and a look at the text tell that at no
    cost an entry); a set or a sum of values cannot tell ``True`` or ``1.0`` from ``1``.
    ``entries_only``: the entries are a :class:`TableEntries`, built on first use, and the
    requires_grad names and hints are left empty (a reader of entries needs neither).
    """
    if not ints_only or tf_raw != {} or type(rows) is not list or not names:
        return None
    try:
        checked = _check(names, files, dtypes, rows)
    except (IndexError, TypeError):
        # cut short, or a string, null, list or object where an integer belongs: an index or a
        # comparison with an integer fails on it, or a set of integers does not hold it
        return None
    if checked is None:
        return None
    starts, codes, name_set = checked
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
           rows: list[Any]) -> tuple[list[int], list[int], frozenset[str]] | None:
    """(where each entry starts, each entry's dtype code, the names) if every value is sound, else None."""
    starts = _starts(names, rows)
    name_set = frozenset(names)
    if starts is None or len(name_set) != len(names):
        return None
    codes = _col(rows, starts, 0)
    in_files = frozenset(range(len(files)))
    if not set(codes) <= frozenset(range(-1, len(dtypes))):
        return None
    at = starts
    if min(codes) < 0:  # bytes items among the tensors: their file, file_offset, length and index
        is_bytes = list(map((-1).__eq__, codes))
        b = list(compress(starts, is_bytes))
        if not (set(_col(rows, b, 1)) <= in_files and _within(_col(rows, b, 2), 0) and _within(_col(rows, b, 3), 0)
                and _within(_col(rows, b, 4), -1)):
            return None
        at = list(compress(starts, map((-1).__lt__, codes)))
    nds = _col(rows, at, 2)
    if not set(nds) <= _NDIMS:
        return None
    itemsizes = [t[1] for t in dtypes]
    for nd in set(nds):
        if not _rank_sound(_rank_rows(rows, at, nds, nd, at is starts), nd, in_files, itemsizes):
            return None
    return starts, codes, name_set


def _rank_rows(rows: list[Any], at: list[int], nds: list[int], nd: int, all_tensors: bool) -> list[Any]:
    """The values of the tensors of rank ``nd``, one after another: ``9 + nd`` each."""
    if all_tensors and nds.count(nd) == len(nds):
        return rows  # every entry a tensor of this rank: the rows are just that
    at_nd = list(compress(at, map(nd.__eq__, nds)))
    return list(chain.from_iterable(map(rows.__getitem__, map(slice, at_nd, map(add, at_nd, repeat(9 + nd))))))


def _rank_sound(flat: list[Any], nd: int, in_files: frozenset[int], itemsizes: list[int]) -> bool:
    """Whether the tensors of one rank (``flat``: their values, ``9 + nd`` each) are sound.

    Each field is then a column ``flat[k::9 + nd]``, a slice made in C; the dtype codes and
    ranks are already known to be in range, and the chunk count and whole flag to be 1.
    """
    step = 9 + nd
    n = list(map(itemsizes.__getitem__, flat[0::step]))
    if not set(flat[1::step]) <= _FLAGS:
        return False
    for k in range(nd):
        size = flat[3 + k::step]
        if not _within(size, 0):
            return False
        n = list(map(mul, n, size))
    lns = flat[6 + nd::step]
    if lns != n or (n and max(n) > fmt.MAX_INT):  # each record's length is its byte count (n >= 0)
        return False
    return (set(flat[4 + nd::step]) <= in_files and _within(flat[5 + nd::step], 0)
            and _within(set(flat[7 + nd::step]), -1))


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
