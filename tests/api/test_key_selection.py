"""Choosing entries as the CLI does: ``load(keys=[glob, ...])`` and ``strip_prefix=`` on ``open``/``load``/``load_into``.

``load(keys=...)`` takes the patterns ``convert --keys`` takes and selects exactly what
``convert`` selects (checked by converting with the same patterns and listing the result);
a ``model.``-prefixed training checkpoint goes straight into ``load_state_dict``.
"""

from __future__ import annotations

import fnmatch

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
import torch
from torch import nn

import helpers
import mmapckpt
from mmapckpt.reading.keys import matches, pick


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 3)
        self.out = nn.Linear(3, 2)


@pytest.fixture(scope="module")
def training(tmp_path_factory):
    """A training checkpoint: the model under ``model.``, an optimizer state and a step counter."""
    d = tmp_path_factory.mktemp("train")
    torch.manual_seed(0)
    net = Net()
    sd = {f"model.{k}": v for k, v in net.state_dict().items()}
    sd.update({"optim.state.0.exp_avg": torch.randn(3, 4), "optim.state.0.step": torch.tensor(7.0),
               "step": torch.tensor(100), "modelx.w[0]": torch.zeros(2)})
    mmapckpt.save(sd, d / "ckpt")
    return d / "ckpt", net, sd


@pytest.mark.parametrize("patterns", [["model.*"], ["model.layer.*", "step"], ["*.weight"], ["optim.*.step", "model.out.bias"],
                                      ["model.?ayer.bias"], ["modelx.w[[]0]"], ["modelx.w[0]"]])
def test_load_keys_select_what_convert_keys_selects(training, tmp_path, patterns) -> None:
    path, _, sd = training
    got = mmapckpt.load(path, keys=patterns)
    out = tmp_path / "sel.safetensors"
    mmapckpt.convert(path, out, to="safetensors", keys=patterns)
    with mmapckpt.open(out) as f:
        assert sorted(got) == sorted(f.keys())
    assert list(got) == [n for n in sd if any(n == p or fnmatch.fnmatchcase(n, p) for p in patterns)]  # stored order
    for n, t in got.items():
        helpers.assert_bitwise_equal(t, sd[n])


def test_a_pattern_matching_nothing_raises(training) -> None:
    path, _, _ = training
    with pytest.raises(KeyError, match=r"glob patterns.*\['nope\.\*'\]"):
        mmapckpt.load(path, keys=["model.*", "nope.*"])
    with pytest.raises(KeyError, match="'Model.layer.weight'"):  # case-sensitive, as --keys
        mmapckpt.load(path, keys=["Model.layer.weight"])
    with pytest.raises(TypeError, match="single string"):
        mmapckpt.load(path, keys="model.*")


def test_training_checkpoint_straight_into_load_state_dict(training) -> None:
    path, net, _ = training
    fresh = Net()
    fresh.load_state_dict(mmapckpt.load(path, keys=["model.*"], strip_prefix="model."))  # strict: exact names
    for n, t in fresh.state_dict().items():
        helpers.assert_bitwise_equal(t, net.state_dict()[n])


def test_strip_prefix_keeps_unprefixed_names_and_keys_match_stored_names(training) -> None:
    path, _, sd = training
    got = mmapckpt.load(path, strip_prefix="model.")
    assert sorted(got) == sorted(["layer.weight", "layer.bias", "out.weight", "out.bias", "optim.state.0.exp_avg",
                                  "optim.state.0.step", "step", "modelx.w[0]"])
    assert list(mmapckpt.load(path, keys=["model.out.*"], strip_prefix="model.")) == ["out.weight", "out.bias"]


def test_open_with_strip_prefix(training) -> None:
    path, net, sd = training
    with mmapckpt.open(path, strip_prefix="model.") as f:
        assert "layer.weight" in f and "model.layer.weight" not in f
        helpers.assert_bitwise_equal(f.get_tensor("layer.weight"), sd["model.layer.weight"])
        helpers.assert_bitwise_equal(f.get_slice("out.weight")[1:], sd["model.out.weight"][1:])
        assert f.info("layer.weight").name == "model.layer.weight"  # entries keep their stored names
        assert f.offset_keys()[:4] == ["layer.weight", "layer.bias", "out.weight", "out.bias"]


def test_load_into_with_strip_prefix(training) -> None:
    path, net, _ = training
    fresh = Net()
    assert mmapckpt.load_into(fresh.state_dict(), path, strip_prefix="model.") == []
    for n, t in fresh.state_dict().items():
        helpers.assert_bitwise_equal(t, net.state_dict()[n])


@pytest.mark.parametrize("prefix, match", [("model", r"leaves '\.layer\.weight'; did you mean strip_prefix 'model\.'"),
                                           ("nothing.", "no selected entry starts with strip_prefix 'nothing.'"),
                                           ("", "non-empty")])
def test_strip_prefix_mistakes(training, prefix, match) -> None:
    path, _, _ = training
    err = ValueError if not prefix else mmapckpt.CheckpointError
    for call in (lambda: mmapckpt.open(path, strip_prefix=prefix), lambda: mmapckpt.load(path, strip_prefix=prefix),
                 lambda: mmapckpt.load_into({}, path, strip_prefix=prefix)):
        with pytest.raises(err, match=match):
            call()


def test_two_names_made_one_refused(tmp_path) -> None:
    mmapckpt.save({"model.w": torch.zeros(1), "w": torch.ones(1)}, tmp_path / "c")
    with pytest.raises(mmapckpt.CheckpointError, match="the same name 'w'"):
        mmapckpt.open(tmp_path / "c", strip_prefix="model.")


_NAME = st.text(alphabet="ab.0[]", min_size=1, max_size=5)


@settings(max_examples=300, deadline=None)
@example(names=["a[0]", "a0"], patterns=["a[0]"])  # a name that is also a wildcard pattern matching another
@given(names=st.lists(_NAME, max_size=8, unique=True),
       patterns=st.lists(st.text(alphabet="ab.0[]*?!", min_size=1, max_size=5), min_size=1, max_size=5))
def test_pick_selects_what_matching_each_name_against_each_pattern_does(names, patterns) -> None:
    """keys.pick (a set lookup for names, one regex for the wildcards) is keys.matches applied pairwise."""
    assert pick(names, patterns) == ([n for n in names if matches(n, patterns)],
                                     [p for p in patterns if not any(matches(n, (p,)) for n in names)])
