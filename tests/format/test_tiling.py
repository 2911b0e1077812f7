"""format/tiling.py: exact chunk tiling (signed corners, and the sweep beyond their budget),
stored byte ranges that alias only as tied weights, and shapes torch can make."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mmapckpt.errors import EntryBoundsError, FormatError
from mmapckpt.format import tiling
from mmapckpt.format.entries import ChunkInfo, EntryInfo
from mmapckpt.format.tiling import check_entries, shape_fits, tiling_problem

from strategies import layouts, tilings


def _covers_exactly(shape, boxes) -> bool:
    """The brute-force answer: count every element's chunks."""
    counts = np.zeros(shape, dtype=np.int64)
    for off, sz in boxes:
        if any(o < 0 or s < 0 or o + s > g for o, s, g in zip(off, sz, shape)):
            return False
        counts[tuple(slice(o, o + s) for o, s in zip(off, sz))] += 1
    return bool((counts == 1).all())


@given(tilings())
@settings(max_examples=300, deadline=None)
def test_every_tiling_is_accepted(case):
    shape, boxes = case
    assert _covers_exactly(shape, boxes)
    assert tiling_problem(shape, boxes) is None


@given(layouts())
@settings(max_examples=600, deadline=None)
def test_the_check_agrees_with_counting_every_element(case):
    shape, boxes = case
    assert (tiling_problem(shape, boxes) is None) == _covers_exactly(shape, boxes), (shape, boxes)


@given(layouts())
@settings(max_examples=300, deadline=None)
def test_the_sweep_agrees_with_counting_too(case):
    """Past the corner budget the sweep decides alone: it must give the same answers."""
    shape, boxes = case
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tiling, "MAX_CORNER_WORK", 0)
        assert (tiling_problem(shape, boxes) is None) == _covers_exactly(shape, boxes), (shape, boxes)


def test_the_issue_s_gap_and_overlap_is_named():
    # 4 rows as [0:3] and [1:2]: the volumes add up to 4, row 1 is held twice, row 3 never
    msg = tiling_problem((4, 5), [((0, 0), (3, 5)), ((1, 0), (1, 5))])
    assert msg is not None and "[0, 0] and [1, 0] overlap" in msg
    assert "hold 3 of the tensor's 4" in tiling_problem((4,), [((0,), (3,))])
    assert "outside" in tiling_problem((4,), [((2,), (3,))])


def test_a_layout_too_complex_to_check_is_refused_not_loaded(monkeypatch):
    monkeypatch.setattr(tiling, "MAX_CORNER_WORK", 0)
    monkeypatch.setattr(tiling, "MAX_SWEEP_WORK", 3)
    rows = [((i, 0), (1, 2)) for i in range(8)]
    assert "too complex" in tiling_problem((8, 2), rows[:4] + [((4, 0), (4, 1)), ((4, 1), (4, 1))])


def test_many_one_row_chunks_are_checked_through_the_corners(monkeypatch):
    """12,000 one-row chunks (a large world's layout) never reach the pairwise sweep."""
    def no_sweep(*a):
        raise AssertionError("the sweep ran")
    monkeypatch.setattr(tiling, "_overlapping_pair", no_sweep)
    n = 12_000
    rows = [((i, 0), (1, 3)) for i in range(n)]
    assert tiling_problem((n, 3), rows) is None
    grid = [((i, j), (1, 1)) for i in range(100) for j in range(120)]
    assert tiling_problem((100, 120), grid) is None


@given(st.lists(st.integers(0, 2**63 - 1), min_size=1, max_size=4).filter(lambda s: 0 in s))
@settings(max_examples=200, deadline=None)
def test_zero_element_shapes_that_fit_are_made_by_torch(shape):
    if shape_fits(shape):
        assert torch.empty(shape).numel() == 0
    else:
        n = 1
        for s in shape:
            n *= max(s, 1)
        assert n > 2**63 - 1


@pytest.mark.parametrize("shape", [[0, 2**63], [0, 2**62, 4], [2**62, 0, 4], [0, 2**63 - 1, 2]])
def test_zero_element_shapes_with_huge_dimensions_do_not_fit(shape):
    assert not shape_fits(shape)


def _t(name, chunks, shape=(4,), dtype=torch.float32):
    return EntryInfo(name, "tensor", dtype, shape, tuple(ChunkInfo(*c) for c in chunks))


def test_tied_weights_may_share_their_bytes():
    a = _t("a", [((0,), (4,), "f", 64, 16)])
    b = _t("b", [((0,), (4,), "f", 64, 16)])
    check_entries([a, b], "ckpt")
    two = [((0,), (2,), "f", 64, 8), ((2,), (2,), "f", 128, 8)]
    check_entries([_t("a", two), _t("b", two)], "ckpt")  # chunked tied weights too


@pytest.mark.parametrize("entries, match", [
    # one chunk listed for every row of a tensor: a small file standing for much more data
    ([_t("a", [((i,), (1,), "f", 64, 4) for i in range(4)])], "two of its chunks"),
    ([_t("a", [((0,), (4,), "f", 64, 16)]), _t("b", [((0,), (4,), "f", 72, 16)])], "overlaps"),
    ([_t("a", [((0,), (2,), "f", 64, 8), ((2,), (2,), "f", 128, 8)]),
      _t("b", [((0,), (2,), "f", 64, 8), ((2,), (2,), "f", 256, 8)])], "not tied weights"),
    ([_t("a", [((0,), (4,), "f", 64, 16)]), _t("b", [((0,), (4,), "f", 64, 16)], dtype=torch.int32)],
     "not tied weights"),
    ([EntryInfo("o", "object", None, None, (ChunkInfo((), (), "f", 64, 16),)),
      EntryInfo("p", "object", None, None, (ChunkInfo((), (), "f", 64, 16),))], "not tied weights"),
])
def test_stored_bytes_shared_other_than_as_tied_weights_are_refused(entries, match):
    with pytest.raises(EntryBoundsError, match=match) as e:
        check_entries(entries, "ckpt")
    assert e.value.path == "ckpt" and e.value.entry


def test_ranges_in_different_files_or_of_torch_files_never_clash():
    check_entries([_t("a", [((0,), (4,), "f", 64, 16)]), _t("b", [((0,), (4,), "g", 64, 16)])], "ckpt")
    check_entries([_t("a", [((0,), (4,), "f", -1, 16)]), _t("b", [((0,), (4,), "f", -1, 16)])], "ckpt")


def test_shape_and_tiling_defects_name_the_entry():
    with pytest.raises(FormatError, match="no valid strides") as e:
        check_entries([_t("z", [((0, 0), (0, 2**62), "f", 64, 0)], shape=(0, 2**62))
                       ._replace(shape=(0, 2**62, 4), chunks=(ChunkInfo((0, 0, 0), (0, 2**62, 4), "f", 64, 0),))],
                      "ckpt")
    assert e.value.entry == "z"
    with pytest.raises(FormatError, match="hold 3 of") as e:
        check_entries([_t("w", [((0,), (3,), "f", 64, 12)])], "ckpt")
    assert e.value.entry == "w"
