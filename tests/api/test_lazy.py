"""mmapckpt.open / mmapckpt.load: values, slices, selection, casting, objects, errors.

The property tests save random state dicts from 1, 2 and 4 real gloo ranks (DTensors
with random shardings, uneven and empty shards included), as mmapckpt and as stock
DCP, and compare what the lazy API returns with the tensors the ranks were built
from and with what dcp.load writes into full-size targets, byte for byte.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint import FileSystemWriter

import helpers
import lazy_dist
import mmapckpt
from mmapckpt.format import layout as fmt
from mmapckpt.io.staging import StagingPool
from mmapckpt.lazy import _load_to_device
from mmapckpt.format.metadata import encode_metadata
from mmapckpt.dcp.metadata import read_metadata_file

warnings.filterwarnings("ignore", message="torch.distributed is disabled")

DTYPE_NAMES = sorted(fmt.DTYPES)
MESHES = {1: [(1,)], 2: [(2,)], 4: [(4,), (2, 2)]}


# ---------------------------------------------------------------------------- strategies
@st.composite
def specs(draw: st.DrawFn, world: int) -> lazy_dist.Spec:
    """A state dict description: DTensors (random placements) and plain tensors of any dtype."""
    out = []
    for i in range(draw(st.integers(1, 5))):
        shape = tuple(draw(st.lists(st.integers(0, 7).map(lambda x: (x + 1) % 8), min_size=0, max_size=3)))
        mesh = draw(st.sampled_from(MESHES[world]))
        placements = None
        if draw(st.sampled_from(["dtensor", "plain"])) == "dtensor":
            choices = [("S", d) for d in range(len(shape))] + [("R",)]
            placements = tuple(draw(st.sampled_from(choices)) for _ in mesh)
        out.append((f"layer{i}.w", draw(st.sampled_from(DTYPE_NAMES)), shape, mesh, placements,
                    draw(st.integers(0, 2**31 - 1))))
    return out


@st.composite
def basic_index(draw: st.DrawFn, shape: tuple[int, ...]) -> object:
    """Random basic indexing: ints (negative too), slices with steps, an Ellipsis, fewer dims."""
    per_dim: list[object] = []
    for size in shape:
        if size and draw(st.booleans()):
            per_dim.append(draw(st.integers(-size, size - 1)))
        else:
            bound = st.one_of(st.none(), st.integers(-size - 2, size + 2))
            per_dim.append(slice(draw(bound), draw(bound), draw(st.one_of(st.none(), st.integers(1, 4)))))
    a = draw(st.integers(0, len(shape)))
    parts = per_dim[:a]
    if draw(st.booleans()):  # an Ellipsis standing for dims [a, b), then indices for the rest
        parts += [Ellipsis] + per_dim[draw(st.integers(a, len(shape))):]
    if len(parts) == 1 and draw(st.booleans()):
        return parts[0]
    return tuple(parts)


# ---------------------------------------------------------------------------- checks
def _fill(t: torch.Tensor, byte: int = 0x5A) -> torch.Tensor:
    if t.numel():
        t.view(-1).view(torch.uint8).fill_(byte & 1 if t.dtype == torch.bool else byte)
    return t


def _check_checkpoint(path: str, spec: lazy_dist.Spec, data: st.DataObject, n_slices: int) -> None:
    expected = {name: lazy_dist.full_tensor(dt, shape, seed) for name, dt, shape, _, _, seed in spec}
    loaded = mmapckpt.load(path)
    assert set(loaded) == set(expected)
    targets = {n: _fill(torch.empty(t.shape, dtype=t.dtype)) for n, t in expected.items()}
    dcp.load(targets, storage_reader=mmapckpt.MmapReader(path), no_dist=True)
    into = {n: _fill(torch.empty(t.shape, dtype=t.dtype)) for n, t in expected.items()}
    mmapckpt.load_into(into, path)  # chunks saved by several ranks, assembled without DCP's planner
    with mmapckpt.open(path) as f:
        assert set(f.keys()) == set(expected) | {lazy_dist.OBJECT_NAME}
        assert f.get_object(lazy_dist.OBJECT_NAME, allow_unpickle=True) == lazy_dist.OBJECT_VALUE
        for name, exp in expected.items():
            helpers.assert_bitwise_equal(targets[name], exp, f"dcp.load {name}")
            helpers.assert_bitwise_equal(loaded[name], targets[name], f"load {name}")
            helpers.assert_bitwise_equal(into[name], exp, f"load_into {name}")
            helpers.assert_bitwise_equal(f.get_tensor(name), targets[name], f"get_tensor {name}")
            info = f.metadata(name)
            assert (info.dtype, info.shape) == (exp.dtype, tuple(exp.shape))
        with StagingPool("cpu", staging_bytes=16, staging_buffers=2) as pool:  # many blocks, buffers reused
            staged = _load_to_device(f, sorted(expected), pool)
        assert pool.max_in_use <= 2
        for name, exp in expected.items():
            helpers.assert_bitwise_equal(staged[name], exp, f"staged {name}")
        for _ in range(n_slices):
            name = data.draw(st.sampled_from(sorted(expected)))
            idx = data.draw(basic_index(expected[name].shape))
            helpers.assert_bitwise_equal(f.get_slice(name)[idx], expected[name][idx], f"{name}[{idx}]")


def _check_zero_copy_planner(path: str, spec: lazy_dist.Spec) -> None:
    """Entries stored whole in one chunk become views (new tensors); the others are copied into the targets.

    "Whole in one chunk" allows extra empty chunks beside it (a dimension split over more ranks
    than it has rows leaves some ranks an empty shard): the view of the full chunk is still the
    whole tensor.
    """
    expected = {name: lazy_dist.full_tensor(dt, shape, seed) for name, dt, shape, _, _, seed in spec}
    targets = {n: _fill(torch.empty(t.shape, dtype=t.dtype)) for n, t in expected.items()}
    originals = dict(targets)
    dcp.load(targets, storage_reader=mmapckpt.MmapReader(path), planner=mmapckpt.ZeroCopyLoadPlanner(),
             no_dist=True)
    with mmapckpt.open(path) as f:
        for name, exp in expected.items():
            helpers.assert_bitwise_equal(targets[name], exp, f"zero-copy dcp.load {name}")
            chunks = f.metadata(name).chunks
            one_chunk = exp.numel() > 0 and any(tuple(c.sizes) == tuple(exp.shape) for c in chunks)
            assert (targets[name] is not originals[name]) == one_chunk, name


def _property(world: int, specs_: list[lazy_dist.Spec], data: st.DataObject, tmp_path_factory) -> None:
    root = str(tmp_path_factory.mktemp(f"w{world}"))
    try:
        helpers.run_distributed(lazy_dist.save_specs, world, specs_, root)
        for i, spec in enumerate(specs_):
            for kind in ("mm", "stock"):
                _check_checkpoint(os.path.join(root, str(i), kind), spec, data, n_slices=15)
            _check_zero_copy_planner(os.path.join(root, str(i), "mm"), spec)
    finally:
        shutil.rmtree(root, ignore_errors=True)


_DIST = settings(max_examples=2, deadline=None, phases=[Phase.explicit, Phase.generate],
                 suppress_health_check=list(HealthCheck))


@pytest.mark.slow
@pytest.mark.distributed
@_DIST
@given(specs_=st.lists(specs(1), min_size=2, max_size=3), data=st.data())
def test_property_world1(specs_, data, tmp_path_factory):
    _property(1, specs_, data, tmp_path_factory)


@pytest.mark.slow
@pytest.mark.distributed
@_DIST
@given(specs_=st.lists(specs(2), min_size=2, max_size=3), data=st.data())
def test_property_world2(specs_, data, tmp_path_factory):
    _property(2, specs_, data, tmp_path_factory)


@pytest.mark.slow
@pytest.mark.distributed
@_DIST
@given(specs_=st.lists(specs(4), min_size=2, max_size=3), data=st.data())
def test_property_world4(specs_, data, tmp_path_factory):
    _property(4, specs_, data, tmp_path_factory)


# ---------------------------------------------------------------------------- single process
def _save(tmp_path, sd, stock: bool = False) -> str:
    path = str(tmp_path / ("stock" if stock else "mm"))
    writer = FileSystemWriter(path, sync_files=False) if stock else mmapckpt.MmapWriter(path, sync_files=False)
    helpers.dcp_save(sd, writer)
    return path


@pytest.fixture
def small(tmp_path):
    sd = {"w": lazy_dist.full_tensor("float32", (6, 5), 1), "b": lazy_dist.full_tensor("bfloat16", (5,), 2),
          "ids": torch.arange(7), "flag": torch.tensor(True), "step": 3,
          "nested": {"h": lazy_dist.full_tensor("float16", (2, 3), 3)}}
    return sd, _save(tmp_path, sd)


@pytest.mark.parametrize("stock", [False, True])
@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_random_state_dicts_single_process(tmp_path_factory, stock, data):
    from strategies import flatten, state_dicts

    sd = data.draw(state_dicts())
    path = _save(tmp_path_factory.mktemp("sd"), sd, stock)
    flat = flatten(sd)
    tensors = {k: v for k, v in flat.items() if isinstance(v, torch.Tensor)}
    loaded = mmapckpt.load(path)
    assert set(loaded) == set(tensors)
    with mmapckpt.open(path) as f:
        assert set(f.keys()) == set(flat)
        for k, v in flat.items():
            if isinstance(v, torch.Tensor):
                helpers.assert_bitwise_equal(f.get_tensor(k), v, k)
                helpers.assert_bitwise_equal(loaded[k], v, k)
            else:
                assert f.get_object(k, allow_unpickle=True) == v
    everything = mmapckpt.load(path, allow_unpickle=True)
    helpers.assert_tree_equal(everything, flat)


def test_keys_order_and_metadata(small):
    sd, path = small
    with mmapckpt.open(path) as f:
        assert f.keys() == list(read_metadata_file(os.path.join(path, ".metadata"))[1].state_dict_metadata)
        assert set(f.keys()) == {"w", "b", "ids", "flag", "step", "nested.h"} and len(f) == 6 and "w" in f
        info = f.metadata("w")
        assert (info.kind, info.dtype, info.shape, info.nbytes) == ("tensor", torch.float32, (6, 5), 120)
        assert [(c.offsets, c.sizes, c.length) for c in info.chunks] == [((0, 0), (6, 5), 120)]
        assert f.metadata("step").kind == "object" and f.metadata("step").dtype is None
        with pytest.raises(KeyError, match="nope"):
            f.metadata("nope")


def test_objects_need_allow_unpickle(small):
    _, path = small
    with mmapckpt.open(path) as f:
        with pytest.raises(mmapckpt.CheckpointError, match="allow_unpickle"):
            f.get_object("step")
        with pytest.raises(mmapckpt.CheckpointError, match="not a tensor"):
            f.get_tensor("step")
        with pytest.raises(mmapckpt.CheckpointError, match="not a tensor"):
            f.get_slice("step")
        with pytest.raises(mmapckpt.CheckpointError, match="is a tensor"):
            f.get_object("w", allow_unpickle=True)
        assert f.get_object("step", allow_unpickle=True) == 3
    assert "step" not in mmapckpt.load(path)
    with pytest.raises(mmapckpt.CheckpointError, match="allow_unpickle"):
        mmapckpt.load(path, keys=["w", "step"])
    assert mmapckpt.load(path, keys=["w", "step"], allow_unpickle=True)["step"] == 3


def test_keys_selection_and_dtype_cast(small):
    sd, path = small
    assert list(mmapckpt.load(path, keys=["ids", "w"])) == ["w", "ids"]  # checkpoint order
    assert set(mmapckpt.load(path, keys=lambda k: k.startswith("nested"))) == {"nested.h"}
    with pytest.raises(KeyError, match="missing"):
        mmapckpt.load(path, keys=["w", "missing"])
    with pytest.raises(TypeError):
        mmapckpt.load(path, keys="w")
    cast = mmapckpt.load(path, dtype=torch.float64)
    for k in ("w", "b", "nested.h"):
        assert cast[k].dtype == torch.float64
    helpers.assert_bitwise_equal(cast["b"], sd["b"].to(torch.float64))
    assert cast["ids"].dtype == torch.int64 and cast["flag"].dtype == torch.bool


def test_views_survive_close_and_writes_never_reach_the_file(small):
    sd, path = small
    shard = os.path.join(path, "__0_0.distcp")
    before = open(shard, "rb").read()
    with mmapckpt.open(path) as f:
        w = f.get_tensor("w")
    loaded = mmapckpt.load(path)
    helpers.assert_bitwise_equal(w, sd["w"])  # the handle is closed; the view still reads the file
    w.fill_(7.0)
    loaded["b"].zero_()
    assert torch.all(w == 7.0)
    assert open(shard, "rb").read() == before
    again = mmapckpt.load(path)
    helpers.assert_bitwise_equal(again["w"], sd["w"])
    helpers.assert_bitwise_equal(again["b"], sd["b"])


def test_closed_handle_refuses(small):
    _, path = small
    f = mmapckpt.open(path)
    f.close()
    with pytest.raises(ValueError, match="closed"):
        f.get_tensor("w")


@pytest.mark.parametrize("index, exc", [((0, 0, 0), IndexError), (6, IndexError), (-7, IndexError),
                                        (slice(None, None, 0), ValueError), (slice(None, None, -1), ValueError),
                                        ((Ellipsis, Ellipsis), IndexError), (None, TypeError), (True, TypeError),
                                        ("a", TypeError)])
def test_slice_errors(small, index, exc):
    _, path = small
    with mmapckpt.open(path) as f, pytest.raises(exc):
        f.get_slice("w")[index]


def test_slice_shape_and_dtype(small):
    sd, path = small
    with mmapckpt.open(path) as f:
        s = f.get_slice("w")
        assert s.get_shape() == [6, 5] and s.get_dtype() == "F32" and s.dtype == torch.float32 and s.shape == (6, 5)
        helpers.assert_bitwise_equal(s[1:5:2, ..., -1], sd["w"][1:5:2, ..., -1])
        assert s[2].is_contiguous() and s[2].shape == (5,)


def test_missing_and_foreign_byte_order(tmp_path, small):
    _, path = small
    with pytest.raises(mmapckpt.CheckpointNotFoundError):
        mmapckpt.open(str(tmp_path / "nothing"))
    bad = str(tmp_path / "be")
    shutil.copytree(path, bad)
    shard = os.path.join(bad, "__0_0.distcp")
    with open(shard, "r+b") as fh:  # preamble byte 12 is the byte order: claim big-endian data
        fh.seek(12)
        assert fh.read(1) == b"\x01"
        fh.seek(12)
        fh.write(b"\x02")
    with pytest.raises(mmapckpt.ByteOrderError, match="big-endian"):
        mmapckpt.open(bad)
    with pytest.raises(mmapckpt.ByteOrderError):
        mmapckpt.load(bad)


def test_chunks_that_do_not_cover_the_tensor_are_refused(tmp_path, small):
    _, path = small
    bad = str(tmp_path / "gap")
    shutil.copytree(path, bad)
    meta = os.path.join(bad, ".metadata")
    _, md = read_metadata_file(meta)
    w = md.state_dict_metadata["w"]
    md.state_dict_metadata["w"] = dataclasses.replace(w, size=torch.Size([12, 5]))  # the chunk is half of it
    with open(meta, "wb") as fh:
        fh.write(encode_metadata(md))
    with pytest.raises(mmapckpt.FormatError, match="entry 'w': the chunks hold 30 of the tensor's 60 elements"):
        mmapckpt.open(bad)  # refused with the metadata, for every reader (dcp.load would leave half the target)


def test_stock_checkpoint(tmp_path, small):
    sd, _ = small
    path = _save(tmp_path, sd, stock=True)
    loaded = mmapckpt.load(path, allow_unpickle=True)
    helpers.assert_tree_equal(loaded, {"w": sd["w"], "b": sd["b"], "ids": sd["ids"], "flag": sd["flag"],
                                       "step": 3, "nested.h": sd["nested"]["h"]})
    with mmapckpt.open(path) as f:
        assert f.kind == "dcp"
        helpers.assert_bitwise_equal(f.get_slice("w")[::2, 1:], sd["w"][::2, 1:])


def test_load_state_dict_assign_on_meta_transformer(tmp_path):
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64, batch_first=True)
    model = torch.nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False).eval()
    path = _save(tmp_path, model.state_dict())
    with torch.device("meta"):
        layer2 = torch.nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64, batch_first=True)
        fresh = torch.nn.TransformerEncoder(layer2, num_layers=2, enable_nested_tensor=False).eval()
    sd = mmapckpt.load(path)
    missing, unexpected = fresh.load_state_dict(sd, strict=True, assign=True)
    assert not missing and not unexpected
    assert all(p.device.type == "cpu" for p in fresh.parameters())
    # assign=True keeps the loaded tensors themselves: the parameters are the mapped views
    ptrs = {t.data_ptr() for t in sd.values()}
    assert all(p.data_ptr() in ptrs for p in fresh.parameters())
    x = torch.randn(3, 7, 32)
    with torch.no_grad():
        helpers.assert_bitwise_equal(fresh(x), model(x))
