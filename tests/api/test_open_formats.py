"""``mmapckpt.open``/``load``/``load_into`` on every format: safetensors files and Hugging Face directories,
torch.save files, mmapckpt and stock DCP checkpoints, compared byte for byte with what their own readers return."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import helpers
import pytest
import safetensors
import safetensors.torch
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint import FileSystemWriter

import mmapckpt
from mmapckpt.format.safetensors import SAFETENSORS_DTYPES
from mmapckpt.io import staging
from mmapckpt.io.staging import StagingPool
from mmapckpt.lazy import _load_to_device

ST_DTYPES = list(SAFETENSORS_DTYPES.values())


def _special(dtype: torch.dtype, n: int, seed: int) -> torch.Tensor:
    """Random bytes, with -0.0 and a NaN payload where the dtype has them (bool: 0/1)."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        return (raw & 1).bool()
    t = raw.view(dtype).clone()
    if dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        t[0] = -0.0
        t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[dtype.itemsize])[1] = -1  # a NaN with payload
    return t


def _state() -> dict[str, torch.Tensor]:
    sd = {f"layers.{i}.{str(dt).removeprefix('torch.')}": _special(dt, 12, i).reshape(3, 4)
          for i, dt in enumerate(ST_DTYPES)}
    sd["empty"] = torch.zeros(0, 5)
    sd["scalar"] = torch.tensor(1.5, dtype=torch.bfloat16)
    return sd


def _write_sharded(sd: dict[str, torch.Tensor], out: str) -> None:
    """A Hugging Face sharded directory as transformers writes it: two files and model.safetensors.index.json."""
    os.makedirs(out)
    names = sorted(sd)
    parts = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for fn, ns in parts.items():
        safetensors.torch.save_file({n: sd[n] for n in ns}, os.path.join(out, fn), metadata={"format": "pt"})
    index = {"metadata": {"total_size": 1}, "weight_map": {n: fn for fn, ns in parts.items() for n in ns}}
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f)
    with open(os.path.join(out, "config.json"), "w") as f:
        f.write("{}")


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("formats")
    sd = _state()
    paths = {"file": str(root / "m.safetensors"), "hf_single": str(root / "hf1"), "hf_sharded": str(root / "hf2"),
             "torch": str(root / "m.pt"), "mmapckpt": str(root / "mm"), "dcp": str(root / "stock")}
    safetensors.torch.save_file(sd, paths["file"], metadata={"format": "pt", "step": "3"})
    os.makedirs(paths["hf_single"])
    safetensors.torch.save_file(sd, os.path.join(paths["hf_single"], "model.safetensors"))
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        with open(os.path.join(paths["hf_single"], name), "w") as f:
            f.write("{}")
    _write_sharded(sd, paths["hf_sharded"])
    torch.save(sd, paths["torch"])
    mmapckpt.save(sd, paths["mmapckpt"])
    dcp.save(sd, storage_writer=FileSystemWriter(paths["dcp"]), no_dist=True)
    return paths


KINDS = ["file", "hf_single", "hf_sharded", "torch", "mmapckpt", "dcp"]


@pytest.mark.parametrize("kind", KINDS)
def test_open_and_load_every_format_bitwise(sources, kind) -> None:
    want = _state()
    path = sources[kind]
    with mmapckpt.open(path) as f:
        assert sorted(f.keys()) == sorted(want) and len(f) == len(want) and sorted(f) == sorted(want)
        assert "empty" in f and "nope" not in f
        for name, t in want.items():
            helpers.assert_bitwise_equal(f.get_tensor(name), t, name)
            info = f.info(name)
            assert (info.dtype, info.shape) == (t.dtype, tuple(t.shape)) and f.metadata(name) == info
        helpers.assert_bitwise_equal(f.get_slice("layers.1.float32")[1:, ::3], want["layers.1.float32"][1:, ::3])
        assert f.get_slice("layers.1.float32").get_shape() == [3, 4]
    sd = mmapckpt.load(path)
    assert list(sd) == list(mmapckpt.open(path).keys())
    helpers.assert_tree_equal(sd, want)
    targets = {n: torch.full_like(t, 0) if t.dtype != torch.bool else torch.zeros_like(t) for n, t in want.items()}
    assert mmapckpt.load_into(targets, path) == []
    helpers.assert_tree_equal(targets, want)


@pytest.mark.parametrize("kind", ["file", "hf_single", "hf_sharded"])
def test_load_equals_safetensors_load_file(sources, kind) -> None:
    path = sources[kind]
    files = [path] if kind == "file" else sorted(os.path.join(path, n) for n in os.listdir(path)
                                                 if n.endswith(".safetensors"))
    want: dict[str, torch.Tensor] = {}
    for fn in files:
        want.update(safetensors.torch.load_file(fn))
    helpers.assert_tree_equal(mmapckpt.load(path), want)
    with mmapckpt.open(path) as f:
        if kind == "file":
            with safetensors.safe_open(path, "pt") as s:
                assert f.keys() == s.keys()  # sorted, as safe_open lists them


def test_torch_file_equals_torch_load_and_keeps_nesting_names(tmp_path) -> None:
    sd = {"model": {"w": torch.randn(4, 4), "b": torch.arange(3)}, "step": 7, "tied": None}
    sd["model"]["t"] = sd["model"]["w"].t()  # a non-contiguous view: returned as torch.load builds it
    path = str(tmp_path / "c.pt")
    torch.save(sd, path)
    ref = torch.load(path, weights_only=True)
    with mmapckpt.open(path) as f:
        assert f.keys() == ["model.w", "model.b", "model.t", "step", "tied"]
        assert f.info("step").kind == "object"
        assert f.get_object("step") == 7  # loaded with weights_only=True: no allow_unpickle needed
        helpers.assert_bitwise_equal(f.get_tensor("model.t"), ref["model"]["t"])
        helpers.assert_bitwise_equal(f.get_slice("model.t")[1:3], ref["model"]["t"][1:3])
        assert f.metadata() is None
    sd2 = mmapckpt.load(path)
    assert sorted(sd2) == ["model.b", "model.t", "model.w"]  # objects only with allow_unpickle, as for DCP
    with pytest.raises(mmapckpt.CheckpointError, match="allow_unpickle"):
        mmapckpt.load(path, keys=["step"])
    assert mmapckpt.load(path, allow_unpickle=True)["step"] == 7


def test_torch_file_that_is_no_state_dict_or_unsafe(tmp_path) -> None:
    torch.save(torch.ones(2), tmp_path / "t.pt")
    with pytest.raises(mmapckpt.FormatError, match="not a state dict"):
        mmapckpt.open(tmp_path / "t.pt")

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned > " + str(tmp_path / "pwned"),))

    torch.save({"x": Evil()}, tmp_path / "evil.pt")
    with pytest.raises(mmapckpt.FormatError, match="weights_only"):
        mmapckpt.load(tmp_path / "evil.pt")
    assert not (tmp_path / "pwned").exists()


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def test_safetensors_tensors_are_views_over_one_mapping(sources) -> None:
    with mmapckpt.open(sources["file"]) as f:
        a, b = f.get_tensor("layers.0.float64"), f.get_tensor("layers.1.float32")
        assert _storage(a) == _storage(b)  # slices of the one mapping of the file, no copy
        before = Path(sources["file"]).read_bytes()
        b.add_(1)  # copy-on-write: never reaches the file
    assert Path(sources["file"]).read_bytes() == before
    helpers.assert_bitwise_equal(mmapckpt.load(sources["file"])["layers.1.float32"], _state()["layers.1.float32"])


def _misaligned(path: str) -> dict[str, torch.Tensor]:
    """A file whose F32/I64 data start at odd offsets: a header not padded to 8 bytes, a U8 tensor first."""
    sd = {"a": torch.arange(3, dtype=torch.uint8), "f": torch.randn(2, 3), "i": torch.arange(5, dtype=torch.int64)}
    header, data, at = {}, b"", 0
    for name, t in sd.items():
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes()
        header[name] = {"dtype": {torch.uint8: "U8", torch.float32: "F32", torch.int64: "I64"}[t.dtype],
                        "shape": list(t.shape), "data_offsets": [at, at + len(raw)]}
        data, at = data + raw, at + len(raw)
    body = json.dumps(header, separators=(",", ":")).encode()
    body += b" " * ((2 - 8 - len(body)) % 8)  # data starts at 2 mod 8: "f" and "i" at 5 mod 8
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(body)) + body + data)
    assert (8 + len(body)) % 8 == 2
    return sd


def test_misaligned_safetensors_are_copied_not_viewed(tmp_path, monkeypatch) -> None:
    path = str(tmp_path / "odd.safetensors")
    want = _misaligned(path)
    helpers.assert_tree_equal(safetensors.torch.load_file(path), want)  # the file is valid for safetensors
    with mmapckpt.open(path) as f:
        f_t = f.get_tensor("f")
        assert f_t.data_ptr() % 4 == 0 and _storage(f_t) != _storage(f.get_tensor("a"))  # a copy
        helpers.assert_tree_equal({n: f.get_tensor(n) for n in f}, want)
    helpers.assert_tree_equal(mmapckpt.load(path), want)
    targets = {n: torch.zeros_like(t) for n, t in want.items()}
    mmapckpt.load_into(targets, path)  # direct reads only for the aligned tensor
    helpers.assert_tree_equal(targets, want)
    monkeypatch.setattr(staging, "STAGE_CPU_TARGETS", True)  # the accelerator path, on CPU targets
    targets = {n: torch.zeros_like(t) for n, t in want.items()}
    mmapckpt.load_into(targets, path, staging_bytes=16, staging_buffers=2)
    helpers.assert_tree_equal(targets, want)


def test_staged_path_for_every_format(sources, monkeypatch) -> None:
    monkeypatch.setattr(staging, "STAGE_CPU_TARGETS", True)
    want = _state()
    for kind in KINDS:
        targets = {n: torch.zeros_like(t) for n, t in want.items()}
        mmapckpt.load_into(targets, sources[kind], staging_bytes=64, staging_buffers=2)
        helpers.assert_tree_equal(targets, want, kind)


def test_device_load_path_for_every_format(sources) -> None:
    """What load(device=...) runs (every chunk through the staging ring), here with a CPU ring."""
    want = _state()
    for kind in KINDS:
        with mmapckpt.open(sources[kind]) as f, StagingPool("cpu", staging_bytes=16, staging_buffers=2) as pool:
            got = _load_to_device(f, sorted(want), pool)
        helpers.assert_tree_equal(got, want, kind)


def test_the_metadata_file_opens_its_directory(sources) -> None:
    for kind in ("mmapckpt", "dcp"):
        with mmapckpt.open(os.path.join(sources[kind], ".metadata")) as f:
            assert f.kind == kind and sorted(f.keys()) == sorted(_state())


def test_load_options_across_formats(sources) -> None:
    want = _state()
    for kind in KINDS:
        # the stored floats are random bits, far outside float16's range: cast them as torch does
        sd = mmapckpt.load(sources[kind], dtype=torch.float16, keys=lambda k: "float" in k, allow_cast=True)
        assert sorted(sd) == sorted(k for k in want if "float" in k), kind
        assert all(t.dtype == torch.float16 for t in sd.values()), kind
        sd = mmapckpt.load(sources[kind], keys=["empty"], verify=True)
        assert list(sd) == ["empty"] and sd["empty"].shape == (0, 5)
        with pytest.raises(KeyError):
            mmapckpt.load(sources[kind], keys=["nope"])


def test_load_into_strict_and_shapes_across_formats(sources) -> None:
    for kind in ("file", "hf_sharded", "torch"):
        with pytest.raises(KeyError):
            mmapckpt.load_into({"nope": torch.zeros(1)}, sources[kind])
        assert mmapckpt.load_into({"nope": torch.zeros(1)}, sources[kind], strict=False) == ["nope"]
        with pytest.raises(mmapckpt.SizeMismatchError):
            mmapckpt.load_into({"empty": torch.zeros(1, 5)}, sources[kind])


def test_safe_open_arguments(sources) -> None:
    with mmapckpt.open(sources["file"], "pt", device="cpu") as f:
        assert f.device == torch.device("cpu")
    with mmapckpt.open(sources["mmapckpt"], framework="torch") as f:
        assert f.kind == "mmapckpt"
    for bad in ("tf", "jax", "flax", "paddle", "mlx"):
        with pytest.raises(ValueError, match="framework"):
            mmapckpt.open(sources["file"], bad)
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="not available"):
            mmapckpt.open(sources["file"], device="cuda")


def test_metadata_is_user_metadata_as_safe_open_gives_it(sources, tmp_path) -> None:
    with mmapckpt.open(sources["file"]) as f, safetensors.safe_open(sources["file"], "pt") as s:
        assert f.metadata() == s.metadata() == {"format": "pt", "step": "3"}
    with mmapckpt.open(sources["hf_single"]) as f, \
            safetensors.safe_open(os.path.join(sources["hf_single"], "model.safetensors"), "pt") as s:
        assert f.metadata() is None and s.metadata() is None
    with mmapckpt.open(sources["hf_sharded"]) as f:
        assert f.metadata() == {"format": "pt"}
    for kind in ("torch", "dcp", "mmapckpt"):
        with mmapckpt.open(sources[kind]) as f:
            assert f.metadata() is None, kind
    mmapckpt.save({"w": torch.ones(2)}, tmp_path / "u", metadata={"author": "me", "step": "9"})
    with mmapckpt.open(tmp_path / "u") as f:
        assert f.metadata() == {"author": "me", "step": "9"}
        assert f.metadata("w") == f.info("w")  # the old spelling of info(name)


def _hf(tmp_path, weight_map: dict, files: dict[str, dict[str, torch.Tensor]]) -> str:
    d = tmp_path / "hf"
    d.mkdir(parents=True)
    for fn, sd in files.items():
        safetensors.torch.save_file(sd, str(d / fn))
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return str(d)


def test_hostile_indexes(tmp_path) -> None:
    one = {"a.safetensors": {"w": torch.ones(2)}}
    with pytest.raises(mmapckpt.FormatError, match="header lacks it") as ei:
        mmapckpt.open(_hf(tmp_path / "1", {"w": "a.safetensors", "v": "a.safetensors"}, one))
    assert ei.value.entry == "v"
    with pytest.raises(mmapckpt.CheckpointError, match="missing"):
        mmapckpt.open(_hf(tmp_path / "2", {"w": "b.safetensors"}, one))
    with pytest.raises(mmapckpt.UnsafePathError):
        mmapckpt.open(_hf(tmp_path / "3", {"w": "../../etc/passwd"}, one))
    d = _hf(tmp_path / "4", {}, one)
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        f.write('{"weight_map": {"w": "a.safetensors", "w": "a.safetensors"}}')
    with pytest.raises(mmapckpt.FormatError, match="twice"):
        mmapckpt.open(d)
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        f.write('{"weight_map": ["a.safetensors"]}')
    with pytest.raises(mmapckpt.FormatError, match="weight_map"):
        mmapckpt.load(d)


def test_index_selects_only_its_names(tmp_path) -> None:
    d = _hf(tmp_path, {"w": "a.safetensors"}, {"a.safetensors": {"w": torch.ones(2), "extra": torch.zeros(1)}})
    assert list(mmapckpt.load(d)) == ["w"]


def test_what_is_not_a_checkpoint(tmp_path) -> None:
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(mmapckpt.CheckpointNotFoundError, match="not a recognised checkpoint"):
        mmapckpt.open(tmp_path / "notes.txt")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text("{}")
    with pytest.raises(mmapckpt.CheckpointNotFoundError, match="model.safetensors"):
        mmapckpt.load(tmp_path / "empty")
    with pytest.raises(mmapckpt.CheckpointNotFoundError, match="URL"):
        mmapckpt.open("hdfs://bucket/model.safetensors")  # a scheme no storage serves (s3://, az://, gs:// are)
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(struct.pack("<Q", 4) + b"{}")
    with pytest.raises(mmapckpt.TruncatedFileError):
        mmapckpt.open(bad)


def test_closed_handle_refuses_for_every_backend(sources) -> None:
    for kind in ("file", "torch"):
        f = mmapckpt.open(sources[kind])
        t = f.get_tensor("layers.1.float32")
        f.close()
        with pytest.raises(ValueError, match="closed"):
            f.get_tensor("layers.1.float32")
        helpers.assert_bitwise_equal(t, _state()["layers.1.float32"])  # views outlive the handle


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(data=st.data())
def test_random_safetensors_files_bitwise(tmp_path_factory, data) -> None:
    from strategies import shapes, tensor_from_bytes

    sd = {}
    for i in range(data.draw(st.integers(1, 5))):
        dt = data.draw(st.sampled_from(ST_DTYPES))
        shape = data.draw(shapes(max_rank=3, max_numel=24))
        n = dt.itemsize
        for s in shape:
            n *= s
        sd[f"t{i}"] = tensor_from_bytes(data.draw(st.binary(min_size=n, max_size=n)), dt, shape)
    path = str(tmp_path_factory.mktemp("rand") / "r.safetensors")
    safetensors.torch.save_file(sd, path)
    helpers.assert_tree_equal(mmapckpt.load(path), safetensors.torch.load_file(path))
    with mmapckpt.open(path) as f:
        for name, t in sd.items():
            idx = tuple(slice(data.draw(st.integers(0, max(0, s - 1))), None, data.draw(st.integers(1, 3)))
                        for s in t.shape)
            helpers.assert_bitwise_equal(f.get_slice(name)[idx], t[idx], name)
