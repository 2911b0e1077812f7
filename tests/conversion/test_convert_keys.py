"""``convert(..., keys=[glob, ...], strip_prefix=...)`` and ``--keys``/``--strip-prefix``.

Filtering is on the stored name, stripping after it; nothing matching and two names made one
by stripping are clear errors. The training-run export is one command:
``mmapckpt convert CKPT OUT --to safetensors --keys 'model.*' --strip-prefix model.``.
"""

from __future__ import annotations

import fnmatch
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import assert_bitwise_equal
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemWriter

import mmapckpt
from mmapckpt import CheckpointError, MmapReader, MmapWriter, convert
from mmapckpt.conversion.common import select_names
from mmapckpt.tools.cli import main


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(8, 4)
        self.out = torch.nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.layer(x))


def _training_checkpoint(path, writer=MmapWriter) -> Net:
    """A training run's checkpoint: {"model": ..., "optim": ...}, flattened by DCP to model.layer.weight, ..."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, storage_writer=writer(path), no_dist=True)
    return model


def _names(path) -> list[str]:
    with mmapckpt.open(path) as f:
        return f.keys()


@pytest.mark.parametrize("writer", [MmapWriter, FileSystemWriter], ids=["mmapckpt", "stock"])
def test_export_model_weights_to_hugging_face_in_one_call(tmp_path, writer) -> None:
    model = _training_checkpoint(tmp_path / "ckpt", writer)
    assert any(n.startswith("optim.") for n in _names(tmp_path / "ckpt"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no non-tensor entry is selected: nothing is dropped
        r = convert(tmp_path / "ckpt", tmp_path / "model.safetensors", to="safetensors", keys=["model.*"],
                    strip_prefix="model.")
    got = load_file(tmp_path / "model.safetensors")
    want = model.state_dict()
    assert set(got) == set(want)
    for k in want:
        assert_bitwise_equal(got[k], want[k], k)
    assert r.tensors == len(want)
    assert r.tensor_bytes == sum(v.numel() * v.element_size() for v in want.values())
    fresh = Net()
    fresh.load_state_dict(got)  # the names a Hugging Face-style loader expects


def test_the_command_line_in_a_subprocess(tmp_path) -> None:
    model = _training_checkpoint(tmp_path / "ckpt")
    p = subprocess.run([sys.executable, "-m", "mmapckpt", "convert", str(tmp_path / "ckpt"), str(tmp_path / "hf"),
                        "--to", "safetensors", "--keys", "model.*", "--strip-prefix", "model.",
                        "--max-shard-size", "100"], capture_output=True, text=True, timeout=300, check=False)
    assert p.returncode == 0, p.stderr
    assert "4 tensors" in p.stdout
    sd = {}
    for name in os.listdir(tmp_path / "hf"):
        if name.endswith(".safetensors"):
            sd.update(load_file(tmp_path / "hf" / name))
    for k, v in model.state_dict().items():
        assert_bitwise_equal(sd[k], v, k)


def test_keys_repeat_and_filter_on_the_stored_name_before_stripping(tmp_path) -> None:
    model = _training_checkpoint(tmp_path / "ckpt")
    assert main(["convert", str(tmp_path / "ckpt"), str(tmp_path / "o"), "--to", "mmapckpt", "-q",
                 "--keys", "model.layer.*", "--keys", "model.out.bias", "--strip-prefix", "model."]) == 0
    out = mmapckpt.load(tmp_path / "o")
    assert list(out) == ["layer.weight", "layer.bias", "out.bias"]
    for k in out:
        assert_bitwise_equal(out[k], model.state_dict()[k], k)
    # a pattern on the stripped name matches nothing: the filter sees the stored names
    with pytest.raises(CheckpointError, match="no entry matches --keys layer.*"):
        convert(tmp_path / "ckpt", tmp_path / "x", to="mmapckpt", keys=["layer.*"], strip_prefix="model.")
    assert not os.path.exists(tmp_path / "x")


def test_dcp_outputs_keep_non_tensor_entries_and_load_into_the_stripped_model(tmp_path) -> None:
    model = _training_checkpoint(tmp_path / "ckpt")
    convert(tmp_path / "ckpt", tmp_path / "m", to="mmapckpt", keys=["model.*"], strip_prefix="model.")
    convert(tmp_path / "ckpt", tmp_path / "s", to="dcp", keys=["model.*"], strip_prefix="model.")
    for path, reader in ((tmp_path / "m", MmapReader), (tmp_path / "s", dcp.FileSystemReader)):
        fresh = Net()
        sd = fresh.state_dict()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(sd, storage_reader=reader(path), no_dist=True)
        for k, v in model.state_dict().items():
            assert_bitwise_equal(fresh.state_dict()[k], v, k)
    md = MmapReader(tmp_path / "m").read_metadata()
    assert set(md.state_dict_metadata) == set(model.state_dict())
    # DCP flattened {"model": {"layer.weight": ...}} to the path ("model", "layer.weight"): the path loses "model"
    assert md.planner_data == {k: (k,) for k in model.state_dict()}
    # the optimizer's step counters are non-tensor entries in some torch versions: kept when selected
    convert(tmp_path / "ckpt", tmp_path / "opt", to="mmapckpt", keys=["optim.*"])
    assert all(n.startswith("optim.") for n in _names(tmp_path / "opt"))


def test_nothing_matching_is_a_clear_error(tmp_path) -> None:
    _training_checkpoint(tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match=r"no entry matches --keys Model\.\*.*case-sensitive.*'model\.") as ei:
        convert(tmp_path / "ckpt", tmp_path / "o.safetensors", to="safetensors", keys=["Model.*"])
    assert ei.value.path == str(tmp_path / "ckpt")
    assert not os.path.exists(tmp_path / "o.safetensors")
    assert main(["convert", str(tmp_path / "ckpt"), str(tmp_path / "o.safetensors"), "--to", "safetensors",
                 "--keys", "nothing*"]) == 1


def test_a_prefix_no_name_has_is_an_error(tmp_path) -> None:
    _training_checkpoint(tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match="no selected entry starts with --strip-prefix 'model/'"):
        convert(tmp_path / "ckpt", tmp_path / "o", to="mmapckpt", keys=["model.*"], strip_prefix="model/")


def test_a_prefix_without_its_dot_is_an_error(tmp_path) -> None:
    _training_checkpoint(tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match="leaves '.layer.weight'; did you mean --strip-prefix 'model.'"):
        convert(tmp_path / "ckpt", tmp_path / "o", to="mmapckpt", keys=["model.*"], strip_prefix="model")


def test_names_made_one_by_stripping_are_an_error(tmp_path) -> None:
    mmapckpt.save({"model.w": torch.ones(2), "w": torch.zeros(2), "model.b": torch.ones(1)}, tmp_path / "c")
    with pytest.raises(CheckpointError, match="gives 'model.w' and 'w' the same name 'w'") as ei:
        convert(tmp_path / "c", tmp_path / "o.safetensors", to="safetensors", strip_prefix="model.")
    assert ei.value.entry == "w"
    assert not os.path.exists(tmp_path / "o.safetensors")
    with pytest.raises(CheckpointError, match="empty name"):
        convert(tmp_path / "c", tmp_path / "o.safetensors", to="safetensors", strip_prefix="w")
    # names without the prefix keep theirs
    convert(tmp_path / "c", tmp_path / "ok.safetensors", to="safetensors", keys=["model.b", "w"],
            strip_prefix="model.")
    assert sorted(load_file(tmp_path / "ok.safetensors")) == ["b", "w"]


@pytest.mark.parametrize("keys, strip, error", [
    ("model.*", None, TypeError), ([], None, ValueError), ([""], None, ValueError), (None, "", ValueError)])
def test_malformed_arguments(tmp_path, keys, strip, error) -> None:
    mmapckpt.save({"model.w": torch.ones(2)}, tmp_path / "c")
    with pytest.raises(error):
        convert(tmp_path / "c", tmp_path / "o", to="mmapckpt", keys=keys, strip_prefix=strip)


_NAME = st.from_regex(r"[a-c]{1,2}(\.[a-c]{1,2}){0,2}", fullmatch=True)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(names=st.lists(_NAME, min_size=1, max_size=8, unique=True),
       pats=st.lists(st.sampled_from(["a.*", "*", "b*", "*.c", "a", "c.?"]), min_size=1, max_size=3),
       prefix=st.sampled_from([None, "a.", "b.", "a"]))
def test_select_names_is_filter_then_strip(names, pats, prefix) -> None:
    chosen = [n for n in names if any(fnmatch.fnmatchcase(n, p) for p in pats)]
    try:
        got = select_names(names, pats, prefix, "ckpt")
    except CheckpointError as e:
        msg = str(e)
        stripped = [n.removeprefix(prefix) for n in chosen] if prefix else chosen
        assert (not chosen or (prefix and not any(n.startswith(prefix) for n in chosen))
                or len(set(stripped)) < len(stripped) or "" in stripped
                or any(n.startswith(".") for n in stripped)), msg
        return
    assert list(got.values()) == chosen  # the source's order, only what matched
    assert list(got) == ([n.removeprefix(prefix) for n in chosen] if prefix else chosen)


def test_nested_planner_paths_lose_the_stripped_keys(tmp_path) -> None:
    t, u = torch.randn(3), torch.randn(2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": {"layer": {"weight": t}}, "other": u}, storage_writer=MmapWriter(tmp_path / "c"),
                 no_dist=True)
    convert(tmp_path / "c", tmp_path / "o", to="mmapckpt", keys=["model.*"], strip_prefix="model.")
    md = MmapReader(tmp_path / "o").read_metadata()
    assert md.planner_data == {"layer.weight": ("layer", "weight")}
    target = {"layer": {"weight": torch.zeros(3)}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(target, storage_reader=MmapReader(tmp_path / "o"), no_dist=True)
    assert_bitwise_equal(target["layer"]["weight"], t)
