"""The version-2 decoder's column path (format/metadata/v2_columns.py) against its per-entry walk.

``v2.decode`` reads a table of the common shape by columns, and falls back to the walk
when in doubt. Every table is decoded with the column path made to decline (the walk
alone) and as it is, with ``ints_only`` True (the parse vouched for the rows' types) and
False (the decoder looks at them itself): all must refuse the same tables with the same
message, and agree on the rest.
"""

from __future__ import annotations

import copy
import json
from contextlib import nullcontext
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed.checkpoint as dcp

import mmapckpt
from helpers import metadata_with_doc
from mmapckpt.storage.commits import read_index_file
from mmapckpt.format import layout as fmt
from mmapckpt.format.metadata import v2, v2_columns
from mmapckpt.format.metadata.index import InvalidMetadata


def _state() -> dict[str, Any]:
    return {"w": torch.randn(5, 4), "b": torch.arange(3, dtype=torch.int16), "e": torch.empty(0, 2),
            "s": torch.tensor(1.5, dtype=torch.bfloat16), "p": torch.nn.Parameter(torch.ones(2, 3, 2)),
            "opt": {"step": 3, "lr": [0.1, 0.2]}, "v": torch.zeros(7, dtype=torch.float64)}


@pytest.fixture(scope="module")
def doc(tmp_path_factory) -> dict[str, Any]:
    """The body of a checkpoint with tensors of ranks 0 to 3, four dtypes, an empty tensor and bytes items."""
    path = tmp_path_factory.mktemp("bulk") / "c"
    dcp.save(_state(), storage_writer=mmapckpt.MmapWriter(path), no_dist=True)
    return json.loads((path / ".metadata").read_bytes()[24:])


def _decode(doc: dict[str, Any], ints_only: bool, entries_only: bool = False, columns: bool = True) -> tuple[str, Any]:
    """The decoder's outcome; ``columns=False``: with the column path made to decline (the walk alone)."""
    declined = nullcontext() if columns else mock.patch.object(v2, "bulk_index", lambda *a, **k: None)
    try:
        with declined:
            ix = v2.decode(copy.deepcopy(doc), "x/.metadata", ints_only=ints_only, entries_only=entries_only)
    except (InvalidMetadata, mmapckpt.CheckpointError) as e:
        return "refused", f"{type(e).__name__}: {e}"
    except (IndexError, ValueError):  # the decoder's caller turns these into FormatError
        return "refused", "cut short"
    return "ok", (dict(ix.entries), ix.requires_grad, ix.record_index, ix.transforms)


def _vouched(doc: dict[str, Any]) -> bool:
    """Whether the parse would say ``ints_only`` of the rows (no bool or float among them)."""
    rows = doc["table"].get("rows")
    return not (type(rows) in (list, tuple) and any(type(v) in (bool, float) for v in rows))


def _same(doc: dict[str, Any]) -> str:
    walk = _decode(doc, ints_only=False, columns=False)
    assert _decode(doc, ints_only=False) == walk
    if _vouched(doc):
        assert _decode(doc, ints_only=True) == walk
    bulk_entries = _decode(doc, ints_only=_vouched(doc), entries_only=True)
    assert bulk_entries[0] == walk[0]
    if walk[0] == "ok":
        assert bulk_entries[1][0] == walk[1][0]  # the entries; grad and hints are left out
    return walk[0]


def test_the_bulk_check_takes_a_table_of_the_common_shape(doc) -> None:
    t = doc["table"]
    assert len(t["dtypes"]) >= 4 and -1 in t["rows"]  # several dtypes, bytes items among the tensors
    assert t["transforms"] == {}
    got = v2_columns.bulk_index(t["names"], frozenset(t["names"]), t["files"], [fmt.DTYPES[n] for n in t["dtypes"]],
                                t["rows"])
    assert got is not None  # not a fallback: the bulk path itself is what is compared below
    assert _same(doc) == "ok"
    ok = _decode(doc, ints_only=True)[1]
    assert ok[0]["p"].shape == (2, 3, 2) and ok[0]["p"].chunks[0].offsets == (0, 0, 0) and "p" in ok[1]
    assert ok[0]["s"].shape == () and ok[0]["opt.step"].kind == "object"
    assert ok[2][("w", (0, 0))] == 0 and ("opt.step", None) not in ok[2]  # DCP gives bytes items no index


HOSTILE = [-3, -2, -1, 0, 1, 2, 3, 7, 64, 65, 79, 80, 2**63 - 1, 2**63, 2**70, "1", None, [1], {}, True, False, 1.0]


def test_every_value_of_the_rows_changed_is_judged_as_the_walk_judges_it(doc) -> None:
    n = len(doc["table"]["rows"])
    outcomes = set()
    for i in range(n):
        for v in HOSTILE:
            d = copy.deepcopy(doc)
            d["table"]["rows"][i] = v
            outcomes.add(_same(d))
    assert outcomes == {"ok", "refused"}


@pytest.mark.parametrize("change", [
    lambda t: t["rows"].append(0),
    lambda t: t["rows"].pop(),
    lambda t: t["rows"].__setitem__(slice(0, 0), [-1, 0, 0, 0, -1]),
    lambda t: t["names"].__setitem__(1, t["names"][0]),
    lambda t: t["names"].pop(),
    lambda t: t["files"].append("__9_9.distcp"),
    lambda t: t["files"].clear(),
    lambda t: t["dtypes"].pop(),
    lambda t: t["dtypes"].reverse(),
    lambda t: t.update(transforms={"0": ["zstd/1"]}),
    lambda t: t.update(rows=tuple(t["rows"])),
])
def test_other_changes_to_the_table_are_judged_as_the_walk_judges_them(doc, change) -> None:
    d = copy.deepcopy(doc)
    change(d["table"])
    _same(d)


def test_table_entries_are_built_on_first_use(doc) -> None:
    ix = v2.decode(copy.deepcopy(doc), "x/.metadata", ints_only=True, entries_only=True)
    entries = ix.entries
    assert isinstance(entries, v2_columns.TableEntries)
    assert list(entries) == doc["table"]["names"] and len(entries) == len(doc["table"]["names"])
    assert "w" in entries and "nope" not in entries and entries._built is None  # names alone
    assert entries["w"].shape == (5, 4) and entries._built is not None
    assert entries == _decode(doc, ints_only=False, columns=False)[1][0] and entries.get("nope") is None


@pytest.mark.parametrize("name", ["true", "a.false", "1.5"])
def test_a_document_with_true_false_or_a_float_in_it_is_still_read(tmp_path, name) -> None:
    sd = {name: torch.arange(4.0), "w": torch.ones(2, 2)}
    mmapckpt.save(sd, tmp_path / "c")
    path = tmp_path / "c" / ".metadata"
    _, entries, _ = read_index_file(path)
    assert isinstance(entries, v2_columns.TableEntries)  # the rows' types looked at: the columns read it
    assert entries[name].shape == (4,) and list(entries) == [name, "w"]
    raw = path.read_bytes()
    doc = json.loads(raw[24:])
    doc["table"]["rows"][2] = True  # rank True: refused, though true == 1
    path.write_bytes(metadata_with_doc(raw, doc))
    with pytest.raises(mmapckpt.FormatError, match="list of integers"):
        read_index_file(path)


@pytest.mark.parametrize("sd", [
    {f"l{i}.w": torch.full((3,), float(i)) for i in range(5)},  # one rank: no regrouping
    {"a": torch.ones(2, 2), "b": torch.ones(2, 3)},
    {"s": torch.tensor(2.0), "t": torch.tensor(3, dtype=torch.int8)},  # rank 0 only
    {"a": torch.ones(2, 2), "b": torch.ones(3), "c": torch.tensor(1.0), "d": torch.ones(1, 2, 1)},  # ranks 0-3
])
def test_tables_of_tensors_only_are_read_in_bulk_as_the_walk_reads_them(tmp_path, sd) -> None:
    mmapckpt.save(sd, tmp_path / "c")
    doc = json.loads((tmp_path / "c" / ".metadata").read_bytes()[24:])
    assert _same(doc) == "ok"
    _, entries, _ = read_index_file(tmp_path / "c" / ".metadata")
    assert isinstance(entries, v2_columns.TableEntries)
    assert {k: (e.dtype, e.shape) for k, e in entries.items()} == {k: (v.dtype, tuple(v.shape)) for k, v in sd.items()}


def test_a_table_of_bytes_items_only_is_read_in_bulk_as_the_walk_reads_it(tmp_path) -> None:
    dcp.save({"a": 1, "b": "two", "c": [3]}, storage_writer=mmapckpt.MmapWriter(tmp_path / "c"), no_dist=True)
    doc = json.loads((tmp_path / "c" / ".metadata").read_bytes()[24:])
    assert set(doc["table"]["rows"][::5]) == {-1}
    assert _same(doc) == "ok"


@pytest.mark.parametrize("ndim", [64, 65])
def test_a_tensor_of_more_than_64_dims_is_refused_as_the_walk_refuses_it(doc, ndim) -> None:
    d = copy.deepcopy(doc)
    t = d["table"]
    f32 = t["dtypes"].index("float32")
    # a well-formed tensor of ndim dims of size 1, one whole chunk of 4 bytes at offset 0 of the first file
    t["names"].append("many")
    t["rows"].extend([f32, 0, ndim, *[1] * ndim, 1, 0, 0, 4, -1, 1])
    assert _same(d) == ("ok" if ndim == 64 else "refused")
    for only in (False, True):  # tensors only, too: no bytes item before it
        e = copy.deepcopy(d)
        if only:
            e["table"]["names"], e["table"]["rows"] = ["many"], e["table"]["rows"][-(9 + ndim):]
        assert _same(e) == ("ok" if ndim == 64 else "refused")


def test_table_entries_are_built_once_when_threads_ask_at_the_same_time(doc, monkeypatch) -> None:
    import pickle
    import threading
    import time

    calls = []
    build = v2_columns._build

    def slow_build(*args: Any) -> Any:
        calls.append(1)
        time.sleep(0.2)  # every thread asks while the first one builds
        return build(*args)

    monkeypatch.setattr(v2_columns, "_build", slow_build)
    entries = v2.decode(copy.deepcopy(doc), "x/.metadata", ints_only=True, entries_only=True).entries
    got: list[Any] = []
    threads = [threading.Thread(target=lambda: got.append(entries["w"])) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(got) == 4 and all(g is got[0] for g in got)
    assert pickle.loads(pickle.dumps(entries)) == dict(entries.items()) == copy.deepcopy(entries)


def _rec_at(rows: list[Any], starts: list[int], i: int) -> int:
    """Where the record (file, file_offset, length) of entry ``i`` begins in ``rows``."""
    p = starts[i]
    return p + 1 if rows[p] < 0 else p + 4 + rows[p + 2]


def _layout(doc: dict[str, Any]) -> tuple[list[str], list[int]]:
    t = doc["table"]
    starts = v2_columns._starts(t["names"], t["rows"])
    assert starts is not None
    return t["names"], starts


@pytest.mark.parametrize("how, bulk_ok", [
    ("tied", True),  # the same bytes under two names of one dtype and shape: tied weights
    ("inside", False),  # a record starting inside another's bytes
    ("other dtype", False),  # the same bytes as a tensor of another dtype and shape
    ("bytes item", False),  # a pickled value's bytes also a tensor's
])
def test_records_sharing_bytes_are_judged_in_bulk_as_the_walk_judges_them(tmp_path, how, bulk_ok) -> None:
    sd = {"a": torch.arange(16.0), "b": torch.ones(16), "c": torch.zeros(8, dtype=torch.int64), "o": {"k": 1}}
    dcp.save(sd, storage_writer=mmapckpt.MmapWriter(tmp_path / "c"), no_dist=True)
    doc = json.loads((tmp_path / "c" / ".metadata").read_bytes()[24:])
    rows = doc["table"]["rows"]
    names, starts = _layout(doc)
    a, b, c, o = (_rec_at(rows, starts, names.index(n)) for n in ("a", "b", "c", "o.k"))
    if how == "tied":
        rows[b + 1] = rows[a + 1]
    elif how == "inside":
        rows[b + 1] = rows[a + 1] + 8
    elif how == "other dtype":
        rows[c + 1] = rows[a + 1]  # a's 64 bytes as 8 int64
    else:
        rows[o + 1], rows[o + 2] = rows[a + 1], rows[a + 2]
    t = doc["table"]
    assert t["transforms"] == {}
    bulk = v2_columns.bulk_index(t["names"], frozenset(t["names"]), t["files"], [fmt.DTYPES[n] for n in t["dtypes"]],
                                 rows)
    assert (bulk is not None) == bulk_ok
    assert _same(doc) == ("ok" if bulk_ok else "refused")
