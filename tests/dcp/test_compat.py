"""MmapWriter/MmapReader take every keyword argument of torch's FileSystemWriter/FileSystemReader."""

from __future__ import annotations

import inspect
import os

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

import mmapckpt
from helpers import assert_tree_equal, dcp_load, dcp_save


def _stock_defaults(cls: type) -> dict[str, object]:
    sig = inspect.signature(cls.__init__)
    return {n: p.default for n, p in sig.parameters.items() if n not in ("self", "path")}


@pytest.mark.parametrize("stock, ours", [(FileSystemWriter, mmapckpt.MmapWriter),
                                         (FileSystemReader, mmapckpt.MmapReader)])
def test_every_stock_keyword_is_accepted_at_its_default(tmp_path, stock, ours):
    kwargs = _stock_defaults(stock)
    assert kwargs, "torch's signature should list keyword arguments"
    ours(tmp_path, **kwargs)  # swapping the class is the only change


def test_single_file_per_rank_false_writes_one_file_per_item(tmp_path):
    sd = {"a": torch.randn(10), "b": torch.arange(4), "c": {"d": torch.ones(2, 2)}}
    dcp_save(sd, mmapckpt.MmapWriter(tmp_path, single_file_per_rank=False))
    assert len([n for n in os.listdir(tmp_path) if n.endswith(".distcp")]) == 3
    fresh = {"a": torch.zeros(10), "b": torch.zeros(4, dtype=torch.int64), "c": {"d": torch.zeros(2, 2)}}
    assert_tree_equal(dcp_load(fresh, mmapckpt.MmapReader(tmp_path)), sd)


@pytest.mark.parametrize("kwargs, says", [
    ({"cache_staged_state_dict": True}, "async_stager"),
    ({"serialization_format": "safetensors"}, "mmapckpt convert"),
    ({"per_thread_copy_ahead": -1}, "per_thread_copy_ahead"),
])
def test_stock_options_it_cannot_honour_are_refused_with_what_to_use(tmp_path, kwargs, says):
    with pytest.raises(ValueError, match=says.replace("(", r"\(")):
        mmapckpt.MmapWriter(tmp_path, **kwargs)


def test_stream_transform_arguments_of_the_wrong_type_are_refused(tmp_path):
    with pytest.raises(TypeError, match="StreamTransformExtension"):
        mmapckpt.MmapWriter(tmp_path, _extensions=[object()])
    with pytest.raises(TypeError, match="ExtensionRegistry"):
        mmapckpt.MmapReader(tmp_path, _extension_registry=object())
