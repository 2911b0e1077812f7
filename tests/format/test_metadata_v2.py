"""The version-2 metadata body (the entry table): round trips, and hostile tables refused."""

from __future__ import annotations

import json
from typing import Any, Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
import torch.distributed.checkpoint as dcp

import mmapckpt
from helpers import as_metadata_v1, assert_tree_equal, metadata_with_doc
from mmapckpt.dcp.metadata import read_metadata_file
from mmapckpt.storage.commits import read_index_file
from mmapckpt.errors import FormatError, UnknownDtypeError, UnsafePathError


def _sd() -> dict[str, Any]:
    return {"w": torch.randn(5, 4), "b": torch.arange(3, dtype=torch.int16), "e": torch.empty(0, 2),
            "s": torch.tensor(1.5, dtype=torch.bfloat16), "opt": {"step": 3, "lr": [0.1, 0.2]}}


@pytest.fixture()
def ckpt(tmp_path) -> Any:
    dcp.save(_sd(), storage_writer=mmapckpt.MmapWriter(tmp_path / "c"), no_dist=True)
    return tmp_path / "c"


def _fresh() -> dict[str, Any]:
    return {"w": torch.zeros(5, 4), "b": torch.zeros(3, dtype=torch.int16), "e": torch.empty(0, 2),
            "s": torch.tensor(0.0, dtype=torch.bfloat16), "opt": {"step": 0, "lr": [0.0, 0.0]}}


def test_version_1_and_2_describe_the_same_checkpoint(ckpt) -> None:
    _, v2 = read_metadata_file(ckpt / ".metadata")
    from_v2 = _fresh()
    dcp.load(from_v2, storage_reader=mmapckpt.MmapReader(ckpt), no_dist=True)
    as_metadata_v1(ckpt)
    _, v1 = read_metadata_file(ckpt / ".metadata")
    assert v1.state_dict_metadata == v2.state_dict_metadata and v1.planner_data == v2.planner_data
    assert v1.storage_data == v2.storage_data
    assert sorted((k.fqn, k.index) for k in v1.storage_data) == sorted((k.fqn, k.index) for k in v2.storage_data)
    from_v1 = _fresh()
    dcp.load(from_v1, storage_reader=mmapckpt.MmapReader(ckpt), no_dist=True)
    assert_tree_equal(from_v1, from_v2)


def test_the_table_is_a_sixth_of_the_version_1_bytes(tmp_path) -> None:
    sd = {f"layers.{i}.weight": torch.zeros(2) for i in range(2000)}
    mmapckpt.save(sd, tmp_path / "c")
    v2 = (tmp_path / "c" / ".metadata").stat().st_size
    as_metadata_v1(tmp_path / "c")
    v1 = (tmp_path / "c" / ".metadata").stat().st_size
    assert v2 * 4 < v1, (v2, v1)
    assert_tree_equal(mmapckpt.load(tmp_path / "c"), sd)  # and still loads, from version 1


def _table_error(ckpt: Any, mutate: Callable[[dict[str, Any]], None], lazy_too: bool = True) -> BaseException:
    path = ckpt / ".metadata"
    raw = path.read_bytes()
    doc = json.loads(raw[24:])
    mutate(doc)
    path.write_bytes(metadata_with_doc(raw, doc))
    if lazy_too:
        with pytest.raises(FormatError):
            read_index_file(path)  # what open/load/load_into decode
    with pytest.raises(FormatError) as ei:
        read_metadata_file(path)  # what dcp.load plans with
    assert str(path) in str(ei.value)
    return ei.value


def _set(i: int, v: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(doc: dict[str, Any]) -> None:
        doc["table"]["rows"][i] = v
    return mutate


# w's rows: dtype 0, flags 1, ndim 2, size 3..4, nchunks 5, file 6, file_offset 7, length 8, index 9, whole 10
@pytest.mark.parametrize("mutate, words", [
    (lambda d: d.pop("table"), "'table' must be an object"),
    (lambda d: d["table"].update(names="w"), "'names' must be a list of strings"),
    (lambda d: d["table"]["names"].__setitem__(1, "w"), "names an entry twice"),
    (_set(0, True), "list of integers"),
    (_set(3, 5.0), "list of integers"),
    (_set(3, "5"), "list of integers"),
    (_set(3, -2), "[-1, 2**63)"),
    (_set(3, 2**63), "[-1, 2**63)"),
    (_set(3, -1), "cut short"),
    (_set(0, 9), "names no dtype"),
    (_set(1, 2), "bad flags"),
    (_set(2, 65), "bad flags or more than 64 dims"),
    (_set(6, 7), "names no file"),
    (_set(8, 79), "its chunk holds 80"),
    (_set(7, -1), "negative offset"),
    (_set(10, 2), "bad 'whole' flag"),
    (lambda d: d["table"]["rows"].append(0), "more than the entries"),
    (lambda d: d["table"]["rows"].__delitem__(slice(-3, None)), "ends before"),
    (lambda d: d["table"].update(transforms={"x": ["a/1"]}), "'transforms' must map"),
    (lambda d: d["table"].update(transforms={"0": []}), "'transforms' must map"),
    (lambda d: d.update(planner_data={"rule": "spaces", "paths": {}}), "'planner_data' must be"),
    (lambda d: d.update(storage_meta=[]), "'storage_meta' must be an object"),
])
def test_hostile_tables_are_refused(ckpt, mutate, words) -> None:
    # planner_data is read only to plan a dcp.load; the lazy readers never use it
    err = _table_error(ckpt, mutate, lazy_too="planner_data" not in words)
    assert words in str(err), err


def test_a_chunk_outside_its_tensor_is_refused(ckpt) -> None:
    def mutate(doc: dict[str, Any]) -> None:  # w's one chunk described explicitly, one row past the end
        rows = doc["table"]["rows"]
        rows[10:11] = [0, 1, 0, 5, 4]
    assert "lies outside the tensor" in str(_table_error(ckpt, mutate))


def test_chunks_that_do_not_cover_their_tensor_are_refused(ckpt) -> None:
    def mutate(doc: dict[str, Any]) -> None:  # w: a 4x4 chunk of the 5x4 tensor, its record of that length
        rows = doc["table"]["rows"]
        rows[8] = 64
        rows[10:11] = [0, 0, 0, 4, 4]
    assert "hold 16 of the tensor's 20 elements" in str(_table_error(ckpt, mutate))


def test_an_unknown_dtype_is_refused_by_name(ckpt) -> None:
    err = _table_error(ckpt, lambda d: d["table"]["dtypes"].__setitem__(0, "float3"))
    assert isinstance(err, UnknownDtypeError)


@pytest.mark.parametrize("rel", ["../outside.distcp", "/etc/passwd", "", "a/../../x", "x\x00y"])
def test_files_outside_the_directory_are_refused(ckpt, rel) -> None:
    err = _table_error(ckpt, lambda d: d["table"]["files"].__setitem__(0, rel))
    assert isinstance(err, UnsafePathError)


def test_a_chunk_without_a_storage_record_is_refused_naming_it(ckpt) -> None:
    err = _table_error(ckpt, _set(6, -1))
    assert "no storage record" in str(err) and err.entry == "w@[0, 0]"


@pytest.mark.parametrize("pd, sdm_names", [
    ({"a.b": ("a", "b"), "c": ("c",), "l.0": ("l", 0), "m.x": ("m", "x")}, ["a.b", "c", "l.0", "m.x"]),  # "dots"
    ({"a.b": ("a.b",), "c.d": ("c.d",), "x": ("x",), "l.0": ("l", 0)}, ["a.b", "c.d", "x", "l.0"]),  # "whole"
    ({"a.b": ("a", "b"), "extra": ("e", 1), "more.x": ("more", "x")}, ["a.b"]),  # names DCP plans but has no item of
])
def test_planner_data_is_expanded_to_what_was_saved(pd, sdm_names) -> None:
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

    from mmapckpt.format.metadata.v2 import encode_planner_data, planner_paths

    md = Metadata(state_dict_metadata={k: BytesStorageMetadata() for k in sdm_names}, planner_data=pd)
    raw = json.loads(json.dumps(encode_planner_data(md)))
    got = planner_paths(raw, sdm_names)
    assert got == pd and list(got) == list(pd)
    assert all(type(v) is tuple for v in got.values())


_KEY = st.text(alphabet="ab.", min_size=1, max_size=4)


@settings(max_examples=200, deadline=None)
@given(pd=st.dictionaries(_KEY, st.one_of(_KEY.map(lambda k: None), st.lists(st.one_of(_KEY, st.integers(0, 3)),
                                                                            min_size=1, max_size=3)), max_size=6))
def test_the_planner_data_rule_is_the_majority_rule(pd) -> None:
    """``encode_planner_data`` picks "dots" when at least as many paths are the name split at its dots as are the
    name whole (counted the plain way here), also through its shortcut for all-whole dicts."""
    from torch.distributed.checkpoint.metadata import Metadata

    from mmapckpt.format.metadata.v2 import encode_planner_data, planner_paths

    pd = {k: (k,) if v is None else tuple(v) for k, v in pd.items()}  # None: the usual whole-name path
    md = Metadata(state_dict_metadata={}, planner_data=pd)
    enc = encode_planner_data(md)
    dots = sum(1 for k, v in pd.items() if v == tuple(k.split(".")))
    whole = sum(1 for k, v in pd.items() if v == (k,))
    assert enc["rule"] == ("dots" if dots >= whole else "whole")
    assert planner_paths(json.loads(json.dumps(enc)), []) == pd
