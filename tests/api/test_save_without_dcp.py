"""``mmapckpt.save`` writes DCP's checkpoint without DCP (saving.py): the same metadata and the same bytes as
``dcp.save`` with ``MmapWriter`` of the same flat dict (its tied weights declared to the writer, as the planner
attribute format/aliases.py names), for every dtype, shape, view, tie and ``requires_grad``."""

from __future__ import annotations

import os
import uuid

import pytest

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import MetadataIndex
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from helpers import assert_bitwise_equal
from strategies import tensors

import mmapckpt
from mmapckpt.format.aliases import ALIASES_ATTR, exact_aliases


class _TiesDeclared(DefaultSavePlanner):
    """DCP's default planner, declaring the state dict's exact aliases to the writer."""

    def __init__(self, sd: dict[str, torch.Tensor]) -> None:
        super().__init__()
        setattr(self, ALIASES_ATTR, {MetadataIndex(a, (0,) * sd[a].dim()): MetadataIndex(c, (0,) * sd[c].dim())
                                     for a, c in exact_aliases(sd).items()})


def _described(path: str) -> tuple[dict, dict, object, object]:
    """What a reader learns of a checkpoint: DCP's metadata with each record's file replaced by its
    position among the files, and every entry's bytes as stored."""
    md = mmapckpt.MmapReader(path).read_metadata()
    files = sorted({r.relative_path for r in md.storage_data.values()})
    records = {(i.fqn, tuple(i.offset), i.index): (files.index(r.relative_path), r.offset, r.length)
               for i, r in md.storage_data.items()}
    data = {}
    for (fqn, _, _), (f, off, n) in records.items():
        with open(os.path.join(path, files[f]), "rb") as fh:
            fh.seek(off)
            data[fqn] = fh.read(n)
    return md.state_dict_metadata, records, md.planner_data, data


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                HealthCheck.too_slow])
@given(values=st.lists(tensors(), min_size=0, max_size=6), ties=st.lists(st.integers(0, 5), max_size=2),
       grads=st.lists(st.booleans(), min_size=6, max_size=6), threads=st.integers(1, 3))
def test_save_writes_what_dcp_save_with_mmapwriter_writes(tmp_path_factory, values, ties, grads, threads):
    sd: dict[str, torch.Tensor] = {}
    for k, t in enumerate(values):
        if grads[k] and t.dtype.is_floating_point and t.dtype.itemsize >= 2:
            t = t.detach().clone().requires_grad_(True)
        sd[f"layer.{k}.w"] = t
    for k in ties:  # tied weights: a second name for an earlier tensor
        if k < len(values):
            sd[f"tied.{k}"] = sd[f"layer.{k}.w"]
    base = tmp_path_factory.mktemp("s")
    ours, stock = str(base / uuid.uuid4().hex), str(base / uuid.uuid4().hex)
    saved = mmapckpt.save(sd, ours, metadata={"note": "x"}, thread_count=threads)
    dcp.save(sd, storage_writer=mmapckpt.MmapWriter(stock, thread_count=threads, metadata={"note": "x"}),
             planner=_TiesDeclared(sd), no_dist=True)
    assert _described(ours) == _described(stock)
    assert saved.path == ours and set(saved.write_paths) == {r for r in os.listdir(ours) if r.endswith(".distcp")}
    assert mmapckpt.MmapReader(ours).read_metadata().storage_meta.save_id == saved.save_id
    assert mmapckpt.open(ours).metadata() == {"note": "x"}
    loaded = mmapckpt.load(ours)
    for name, t in sd.items():
        assert_bitwise_equal(loaded[name], t.detach())


@pytest.mark.parametrize("bad", [{"thread_count": 0}, {"alignment": 100}, {"metadata": {"k": 1}}])
def test_bad_options_are_refused_before_anything_is_written(tmp_path, bad):
    """As ``MmapWriter``'s: refused with ValueError/TypeError before the directory is made or locked."""
    with pytest.raises((ValueError, TypeError)):
        mmapckpt.save({"w": torch.ones(3)}, tmp_path / "c", **bad)
    assert not (tmp_path / "c").exists()
