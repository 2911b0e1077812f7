"""plan_items' directly built items are the objects DCP's constructors and helpers make.

Compared field by field with the field types (``tuple(size)`` comparisons would take a
plain tuple for a ``torch.Size``) and the index hints (which ``MetadataIndex.__eq__``
ignores), hashed, pickled, and built both ways (``DIRECT`` on and off).
"""

from __future__ import annotations

import dataclasses
import pickle
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem
from torch.distributed.checkpoint.planner_helpers import _create_write_items

from mmapckpt.dcp import plan_items


def _fields(obj: Any) -> Any:
    """Every field, recursively, each with its exact type."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return (type(obj), tuple((f.name, _fields(getattr(obj, f.name))) for f in dataclasses.fields(obj)))
    return (type(obj), obj)


@pytest.fixture(params=[True, False], ids=["direct", "constructors"])
def direct(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    monkeypatch.setattr(plan_items, "DIRECT", request.param)
    return request.param


def test_this_torch_takes_the_direct_path() -> None:
    assert plan_items.DIRECT  # else the fast planners build items at the constructors' cost


@pytest.mark.parametrize("shape", [(3, 4), (5,), (), (2, 0, 3)])
def test_write_item_of_a_tensor_is_dcps(direct: bool, shape: tuple[int, ...]) -> None:
    for t in (torch.ones(shape), torch.nn.Parameter(torch.ones(shape, dtype=torch.bfloat16)),
              torch.zeros(shape, dtype=torch.int8)):
        (want,) = _create_write_items("a.b", t)
        got = plan_items.tensor_write_item("a.b", t, {})
        assert _fields(got) == _fields(want)
        assert hash(got.index) == hash(want.index)
        assert _fields(pickle.loads(pickle.dumps(got))) == _fields(want)


def test_properties_are_shared_per_kind_of_tensor() -> None:
    props: dict = {}
    a = plan_items.tensor_write_item("a", torch.ones(2), props)
    b = plan_items.tensor_write_item("b", torch.ones(3), props)
    c = plan_items.tensor_write_item("c", torch.ones(3, requires_grad=True), props)
    assert a.tensor_data.properties is b.tensor_data.properties
    assert c.tensor_data.properties.requires_grad and not a.tensor_data.properties.requires_grad


@pytest.mark.parametrize("hint", [None, 0, 3])
def test_metadata_index_is_dcps(direct: bool, hint: int | None) -> None:
    for off in (torch.Size([0, 4]), torch.Size([]), None):
        want = MetadataIndex("x", off, hint)
        got = plan_items.metadata_index("x", off, hint)
        assert _fields(got) == _fields(want) and got.index == want.index
        assert hash(got) == hash(want) and {want: 1}[got] == 1
        with pytest.raises(dataclasses.FrozenInstanceError):
            got.fqn = "y"  # type: ignore[misc]


def test_read_item_is_dcps(direct: bool) -> None:
    sizes, local, stored = torch.Size([4, 6]), torch.Size([0, 0]), torch.Size([4, 0])
    want = ReadItem(type=LoadItemType.TENSOR, dest_index=MetadataIndex("w", local, 0),
                    dest_offsets=torch.Size([0, 0]), storage_index=MetadataIndex("w", stored, 2),
                    storage_offsets=torch.Size([0, 0]), lengths=sizes)
    got = plan_items.read_item("w", local, stored, 2, sizes)
    assert _fields(got) == _fields(want)
    assert (got.dest_index.index, got.storage_index.index) == (0, 2)
    assert _fields(pickle.loads(pickle.dumps(got))) == _fields(want)


def test_write_result_is_dcps(direct: bool) -> None:
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.storage import WriteResult

    info = _StorageInfo("__0_0.distcp", 4096, 64)
    want = WriteResult(index=MetadataIndex("w", torch.Size([0])), size_in_bytes=64, storage_data=info)
    got = plan_items.write_result(MetadataIndex("w", torch.Size([0])), 64, info)
    assert _fields(got) == _fields(want) and got == want
    assert _fields(pickle.loads(pickle.dumps(got))) == _fields(want)


@pytest.mark.parametrize("shape", [(4, 6), (5,), ()])
def test_whole_read_item_is_dcps(direct: bool, shape: tuple[int, ...]) -> None:
    sizes, z = torch.Size(shape), torch.Size([0] * len(shape))
    want = ReadItem(type=LoadItemType.TENSOR, dest_index=MetadataIndex("w", z, 0), dest_offsets=z,
                    storage_index=MetadataIndex("w", z, 0), storage_offsets=z, lengths=sizes)
    got = plan_items.whole_read_item("w", sizes)
    assert _fields(got) == _fields(want)
    assert (got.dest_index.index, got.storage_index.index) == (0, 0)
    assert hash(got.dest_index) == hash(want.storage_index) and got == want
    assert _fields(pickle.loads(pickle.dumps(got))) == _fields(want)
    if direct:  # equal values, one frozen object
        assert got.dest_index is got.storage_index
    with pytest.raises(dataclasses.FrozenInstanceError):
        got.storage_index.fqn = "y"  # type: ignore[misc]
