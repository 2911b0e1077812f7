"""The on-demand DCP Metadata MmapReader plans with (dcp/records.py) against the eager one.

Every checkpoint's ``.metadata`` is decoded both ways: the lazy mappings must hold the
very records ``to_dcp`` builds (index hints included), answer the reader's and the fast
planner's lookups from the index alike, pickle as plain dicts, and a ``dcp.load`` with
``FastLoadPlanner`` must build no record at all for plain tensors.
"""

from __future__ import annotations

import copy
import pickle
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import HealthCheck, given, settings
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

import mmapckpt
from helpers import Invert, assert_tree_equal
from mmapckpt.format import metadata as mf
from mmapckpt.dcp.metadata import decode_metadata, decode_metadata_lazy
from mmapckpt.dcp.records import StateDictRecords, StorageRecords
from strategies import fresh_like, state_dicts


def _state() -> dict[str, Any]:
    return {"w": torch.randn(5, 4), "b": torch.arange(3, dtype=torch.int16), "e": torch.empty(0, 2),
            "s": torch.tensor(1.5, dtype=torch.bfloat16), "p": torch.nn.Parameter(torch.ones(2, 3, 2)),
            "opt": {"step": 3, "lr": [0.1, 0.2]}, "v": torch.zeros(7, dtype=torch.float64)}


def _both(path: Any) -> tuple[Metadata, Metadata]:
    data = (path / ".metadata").read_bytes()
    return decode_metadata(data, "x"), decode_metadata_lazy(data, "x")


def _keys(storage: Any) -> list[tuple[Any, ...]]:
    """The storage keys with their index hints (MetadataIndex equality ignores the hint)."""
    return sorted((k.fqn, tuple(k.offset) if k.offset is not None else None, k.index) for k in storage)


def _assert_same(eager: Metadata, lazy: Metadata, encoded: bool = False) -> None:
    assert type(lazy.state_dict_metadata) is StateDictRecords and type(lazy.storage_data) is StorageRecords
    sdm, storage = lazy.state_dict_metadata, lazy.storage_data
    # asked of the index, before any record is built
    assert len(sdm) == len(eager.state_dict_metadata) and list(sdm) == list(eager.state_dict_metadata)
    assert all(k in sdm for k in eager.state_dict_metadata) and "no such entry" not in sdm
    for idx, info in eager.storage_data.items():
        assert storage.info(idx) == info, idx
        entry, chunk = storage.chunk(idx)
        assert (chunk.file, chunk.file_offset, chunk.length) == (info.relative_path, info.offset, info.length)
        assert sdm.entry(idx.fqn) is entry
    assert storage._r.built is encoded  # none of the lookups above built a record (encoded items: all)
    # then the records themselves
    assert dict(sdm.items()) == eager.state_dict_metadata
    assert dict(storage.items()) == eager.storage_data
    assert _keys(storage) == _keys(eager.storage_data)
    assert lazy == eager and lazy.planner_data == eager.planner_data and lazy.storage_meta == eager.storage_meta
    for idx, info in eager.storage_data.items():  # built now: the same answers
        assert storage.info(idx) == info and storage[idx] == info and idx in storage
    back = pickle.loads(pickle.dumps(lazy))
    assert type(back.state_dict_metadata) is dict and back.state_dict_metadata == eager.state_dict_metadata
    assert type(back.storage_data) is dict and _keys(back.storage_data) == _keys(eager.storage_data)
    assert copy.deepcopy(lazy) == eager


def test_lazy_records_equal_the_eager_ones(tmp_path) -> None:
    dcp.save(_state(), storage_writer=mmapckpt.MmapWriter(tmp_path / "c"), no_dist=True)
    _assert_same(*_both(tmp_path / "c"))


def test_lazy_records_of_encoded_items(tmp_path) -> None:
    dcp.save(_state(), storage_writer=mmapckpt.MmapWriter(tmp_path / "c", _extensions=[Invert()]), no_dist=True)
    eager, lazy = _both(tmp_path / "c")
    assert any(i.transform_descriptors for i in eager.storage_data.values())
    _assert_same(eager, lazy, encoded=True)


def test_lazy_records_of_chunked_tensors(tmp_path) -> None:
    """Tensors stored as several chunks (as a sharded save writes), offsets and index hints as they are."""
    size = torch.Size([4, 6])
    chunks = [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([2, 6])),
              ChunkStorageMetadata(torch.Size([2, 0]), torch.Size([2, 6]))]
    md = Metadata(state_dict_metadata={"t": TensorStorageMetadata(TensorProperties(dtype=torch.float32), size, chunks)},
                  storage_data={MetadataIndex("t", torch.Size([0, 0]), 0): _StorageInfo("__0_0.distcp", 4096, 48),
                                MetadataIndex("t", torch.Size([2, 0]), 1): _StorageInfo("__1_0.distcp", 4096, 48)})
    (tmp_path / ".metadata").write_bytes(mf.encode_metadata(md))
    eager, lazy = _both(tmp_path)
    _assert_same(eager, lazy)
    storage = lazy.storage_data
    assert storage.chunk(MetadataIndex("t", torch.Size([2, 0]), 0)) is not None  # a wrong hint: found by offsets
    assert storage.chunk(MetadataIndex("t", torch.Size([1, 0]))) is None
    assert storage.chunk(MetadataIndex("t")) is None and storage.chunk(MetadataIndex("u", torch.Size([0, 0]))) is None
    assert storage.info(MetadataIndex("t", torch.Size([1, 0]))) is None


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sd=state_dicts())
def test_lazy_records_equal_the_eager_ones_for_any_state_dict(tmp_path_factory, sd) -> None:
    path = tmp_path_factory.mktemp("lazy") / "c"
    dcp.save(sd, storage_writer=mmapckpt.MmapWriter(path), no_dist=True)
    _assert_same(*_both(path))


@pytest.mark.parametrize("planner", [mmapckpt.FastLoadPlanner, DefaultLoadPlanner])
def test_a_load_through_the_reader_is_bitwise_and_fast_planning_builds_no_record(tmp_path, planner) -> None:
    sd = {f"l{i}.w": torch.randn(3, 2).to(dt) for i, dt in enumerate([torch.float32, torch.bfloat16, torch.float16])}
    sd["bytes"] = {"step": 7}
    dcp.save(sd, storage_writer=mmapckpt.MmapWriter(tmp_path / "c"), no_dist=True)
    reader = mmapckpt.MmapReader(tmp_path / "c")
    seen: list[Metadata] = []
    read_metadata = reader.read_metadata

    def recording(*args: Any, **kwargs: Any) -> Metadata:
        md = read_metadata(*args, **kwargs)
        seen.append(md)
        return md

    reader.read_metadata = recording  # type: ignore[method-assign]
    plain = {k: v for k, v in sd.items() if isinstance(v, torch.Tensor)}
    out = fresh_like(plain)
    dcp.load(out, storage_reader=reader, planner=planner(), no_dist=True)
    assert_tree_equal(out, plain)
    built = seen[0].state_dict_metadata._r.built
    assert built is (planner is DefaultLoadPlanner)  # the default planner asks DCP's records; the fast one, the index
    out = fresh_like(sd)
    dcp.load(out, storage_reader=mmapckpt.MmapReader(tmp_path / "c"), planner=planner(), no_dist=True)
    assert_tree_equal(out, sd)


def test_the_reader_names_a_read_with_no_stored_record(tmp_path) -> None:
    dcp.save({"w": torch.ones(4)}, storage_writer=mmapckpt.MmapWriter(tmp_path / "c"), no_dist=True)

    class Elsewhere(mmapckpt.FastLoadPlanner):
        def create_local_plan(self):  # type: ignore[no-untyped-def]
            plan = super().create_local_plan()
            item = plan.items[0]
            wrong = MetadataIndex("w", torch.Size([2]), 0)
            return type(plan)([type(item)(type=item.type, dest_index=item.dest_index, dest_offsets=item.dest_offsets,
                                          storage_index=wrong, storage_offsets=item.storage_offsets,
                                          lengths=item.lengths)])

    with pytest.raises(BaseException) as e:  # DCP's CheckpointException
        dcp.load({"w": torch.zeros(4)}, storage_reader=mmapckpt.MmapReader(tmp_path / "c"), planner=Elsewhere(),
                 no_dist=True)
    err = mmapckpt.checkpoint_error(e.value)
    assert isinstance(err, mmapckpt.FormatError) and "no storage record" in str(err) and "w@[2]" in str(err)
