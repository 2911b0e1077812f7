"""``load_model`` follows the model's ties, not the checkpoint's, and reads one save through one opening.

A checkpoint that stores one tensor under two names (``mmapckpt.save`` of a tied model, a torch.save
file whose two names share a storage) loaded into a model that keeps the names apart must give two
tensors that share no memory: an optimizer step on one leaves the other bitwise as it was. And the
checkpoint is opened once (one metadata read, counted through a medium registered for the test), so a
save that commits while ``load_model`` runs cannot give the model tensors of two saves.
"""

from __future__ import annotations

import pytest
import torch
from helpers import assert_bitwise_equal
from torch import nn

import mmapckpt
from mmapckpt.storage import local, location
from mmapckpt.storage.base import METADATA_NAME


class Tied(nn.Module):
    def __init__(self, tie: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.lm_head = nn.Linear(8, 16, bias=False)
        if tie:
            self.lm_head.weight = self.embed.weight


def _saved_tied(tmp_path, fmt: str) -> tuple[str, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    src = Tied(tie=True)
    sd = src.state_dict()
    assert sd["embed.weight"].data_ptr() == sd["lm_head.weight"].data_ptr()
    if fmt == "mmapckpt":
        path = str(tmp_path / "ckpt")
        mmapckpt.save(sd, path)  # stored once, under both names
    else:
        path = str(tmp_path / "model.pt")
        torch.save(sd, path)  # one storage, two names
    return path, {k: v.detach().clone() for k, v in sd.items()}


def _step(model: nn.Module, opt_cls: type, param: nn.Parameter) -> None:
    """One optimizer step that moves only ``param`` (the only one with a gradient)."""
    opt = opt_cls(model.parameters(), lr=0.5)
    opt.zero_grad()
    param.grad = torch.ones_like(param)
    opt.step()


@pytest.mark.parametrize("fmt", ["mmapckpt", "torch"])
@pytest.mark.parametrize("opt_cls", [torch.optim.SGD, torch.optim.Adam])
@pytest.mark.parametrize("on_meta", [True, False])
def test_names_the_model_keeps_apart_stay_apart(tmp_path, fmt, opt_cls, on_meta) -> None:
    path, ref = _saved_tied(tmp_path, fmt)
    if on_meta:
        with torch.device("meta"):
            model = Tied(tie=False)
    else:
        model = Tied(tie=False)
    assert mmapckpt.load_model(model, path) == ([], [])
    emb, head = model.embed.weight, model.lm_head.weight
    assert emb is not head
    assert_bitwise_equal(emb, ref["embed.weight"])
    assert_bitwise_equal(head, ref["lm_head.weight"])
    _step(model, opt_cls, head)
    assert not torch.equal(head, ref["lm_head.weight"])  # the step moved the head
    assert_bitwise_equal(emb, ref["embed.weight"], "the embedding moved with the head")
    _step(model, opt_cls, emb)
    assert not torch.equal(emb, ref["embed.weight"])


@pytest.mark.parametrize("fmt", ["mmapckpt", "torch"])
def test_names_the_model_ties_stay_one_parameter(tmp_path, fmt) -> None:
    path, ref = _saved_tied(tmp_path, fmt)
    with torch.device("meta"):
        model = Tied(tie=True)
    mmapckpt.load_model(model, path)
    assert model.embed.weight is model.lm_head.weight
    assert_bitwise_equal(model.embed.weight, ref["embed.weight"])
    _step(model, torch.optim.SGD, model.lm_head.weight)
    assert torch.equal(model.embed.weight, model.lm_head.weight)


def test_apart_on_meta_with_a_cast(tmp_path) -> None:
    """The model's dtype differs from the stored one: the one cast is still not shared by two names."""
    path, ref = _saved_tied(tmp_path, "mmapckpt")
    with torch.device("meta"):
        model = Tied(tie=False).to(torch.float64)
    mmapckpt.load_model(model, path)
    model.lm_head.weight.data.add_(1.0)
    assert_bitwise_equal(model.embed.weight, ref["embed.weight"].to(torch.float64))


# ---------------------------------------------------------------------- one opening
SCHEME = "counted"


class Counted(local.LocalStorage):
    """A local directory whose commit reads are counted; ``after_open(n)`` runs after the n-th opening of a shard."""

    reads = [0]
    opens = [0]
    after_open = None

    def __init__(self, url: str, options=None) -> None:
        super().__init__(url.split("://", 1)[1])

    def read_file(self, name: str, limit: int):
        data = super().read_file(name, limit)
        if name == METADATA_NAME:
            Counted.reads[0] += 1
        return data

    def open_file(self, name: str):
        f = super().open_file(name)
        if name.endswith(".distcp"):
            Counted.opens[0] += 1
            if Counted.after_open is not None:
                Counted.after_open(Counted.opens[0])
        return f


@pytest.fixture
def counted():
    location.register_scheme(SCHEME, Counted)
    Counted.reads[0], Counted.opens[0], Counted.after_open = 0, 0, None
    try:
        yield Counted
    finally:
        Counted.after_open = None
        location.register_scheme(SCHEME, None)


class Two(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)


def _half_on_meta() -> Two:
    """``a`` on the meta device (replaced by load_model), ``b`` in memory (filled in place)."""
    model = Two()
    model.a.to("meta")
    return model


def _version(v: float) -> dict[str, torch.Tensor]:
    return {k: torch.full_like(t, v) for k, t in Two().state_dict().items()}


def test_load_model_reads_the_metadata_once(tmp_path, counted) -> None:
    mmapckpt.save(_version(1.0), tmp_path / "c")
    model = _half_on_meta()
    mmapckpt.load_model(model, f"{SCHEME}://{tmp_path / 'c'}")
    assert counted.reads[0] == 1
    for n, t in model.state_dict().items():
        assert_bitwise_equal(t, _version(1.0)[n], n)


def test_a_save_committing_during_load_model_is_not_mixed_in(tmp_path, counted) -> None:
    """Each time a shard is opened, a new save commits at the same place (its shard replaces the one opened, and
    an opening after it reads the new save): the model holds the first save only."""
    path = tmp_path / "c"
    mmapckpt.save(_version(1.0), path)
    counted.after_open = lambda n: mmapckpt.save(_version(1.0 + n), path)
    model = _half_on_meta()
    mmapckpt.load_model(model, f"{SCHEME}://{path}")
    for n, t in model.state_dict().items():
        assert_bitwise_equal(t, _version(1.0)[n], n)
