"""Tensors no checkpoint can hold are refused by name: CheckpointWriteError naming the entry and what to save.

A meta tensor (no data), sparse COO and CSR, mkldnn, nested (strided and jagged), quantized tensors,
a tensor subclass with its own ``__torch_dispatch__`` (torch's TwoTensor) and a lazy module's
uninitialized parameter, through ``mmapckpt.save``, ``dcp.save`` with ``MmapWriter`` (DCP's default
planner, and mmapckpt's FastSavePlanner). ``mmapckpt.save`` refuses before it touches the directory;
``dcp.save`` before the shard is committed. A checkpoint being replaced stays as it was. Before this,
each reached the caller as torch's own error (RuntimeError, NotImplementedError) or a bare ValueError,
naming no entry.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import dcp_failure, tensor_bytes
from torch.testing._internal.two_tensor import TwoTensor

import mmapckpt
from mmapckpt import CheckpointWriteError, FastSavePlanner, MmapWriter


def _unsaveable(kind: str) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # beta/prototype/deprecation notes of the layouts themselves
        return {
            "meta": lambda: torch.empty(4, 3, device="meta"),
            "sparse_coo": lambda: torch.eye(3).to_sparse(),
            "sparse_csr": lambda: torch.eye(3).to_sparse_csr(),
            "mkldnn": lambda: torch.randn(3, 4).to_mkldnn(),
            "nested": lambda: torch.nested.nested_tensor([torch.randn(2), torch.randn(3)]),
            "nested_jagged": lambda: torch.nested.nested_tensor([torch.randn(2), torch.randn(3)], layout=torch.jagged),
            "quantized": lambda: torch.quantize_per_tensor(torch.randn(3), 0.1, 0, torch.qint8),
            "two_tensor": lambda: TwoTensor(torch.randn(3), torch.randn(3)),
            "uninitialized": lambda: torch.nn.parameter.UninitializedParameter(),
        }[kind]()


#: what each message must say
SAYS = {"meta": "meta tensor", "sparse_coo": "torch.sparse_coo", "sparse_csr": "torch.sparse_csr",
        "mkldnn": "torch._mkldnn", "nested": "nested tensor", "nested_jagged": "nested tensor",
        "quantized": "torch.qint8", "two_tensor": "TwoTensor", "uninitialized": "uninitialized parameter"}
KINDS = [k for k in SAYS if k != "mkldnn" or torch.backends.mkldnn.is_available()]
#: DCP's default planner itself fails on these before MmapWriter sees them (its own error, not ours)
PLANNER_FIRST = {"mkldnn", "nested", "nested_jagged", "uninitialized"}


def _old(path: str) -> dict[str, torch.Tensor]:
    sd = {"a": torch.arange(6.0), "b": torch.ones(2, 2, dtype=torch.bfloat16)}
    mmapckpt.save(sd, path)
    with open(os.path.join(path, "notes.txt"), "w") as f:
        f.write("mine\n")
    return sd


def _unchanged(path: str, sd: dict[str, torch.Tensor], names: list[str]) -> None:
    assert sorted(os.listdir(path)) == names
    got = mmapckpt.load(path)
    assert set(got) == set(sd) and all(tensor_bytes(got[k]) == tensor_bytes(sd[k]) for k in sd)


@pytest.mark.parametrize("kind", KINDS)
def test_mmapckpt_save_refuses_by_name_before_touching_the_directory(tmp_path, kind):
    new = str(tmp_path / "new")
    with pytest.raises(CheckpointWriteError, match=SAYS[kind]) as info:
        mmapckpt.save({"ok": torch.ones(3), f"layers.0.{kind}": _unsaveable(kind)}, new)
    assert info.value.entry == f"layers.0.{kind}" and info.value.path == new
    assert "cannot save this tensor" in str(info.value)
    assert not os.path.exists(new)
    old = str(tmp_path / "old")
    sd = _old(old)
    names = sorted(os.listdir(old))
    with pytest.raises(CheckpointWriteError, match=SAYS[kind]):
        mmapckpt.save({"ok": torch.ones(3), kind: _unsaveable(kind)}, old)
    _unchanged(old, sd, names)


@pytest.mark.parametrize("planner", ["default", "fast"])
@pytest.mark.parametrize("kind", KINDS)
def test_dcp_save_with_mmap_writer_refuses_by_name(tmp_path, kind, planner):
    if planner == "default" and kind in PLANNER_FIRST:
        pytest.skip("DCP's default planner raises its own error for this before the writer sees it")
    old = str(tmp_path / "old")
    sd = _old(old)
    names = sorted(os.listdir(old))
    state = {"ok": torch.ones(3), kind: _unsaveable(kind)}
    with pytest.raises(BaseException) as info:  # CheckpointException is a BaseException
        dcp.save(state, storage_writer=MmapWriter(old), no_dist=True,
                 **({"planner": FastSavePlanner()} if planner == "fast" else {}))
    err = dcp_failure(info.value)
    assert isinstance(err, CheckpointWriteError), f"{type(err).__name__}: {err}"
    assert err.entry == kind and SAYS[kind] in str(err), str(err)
    del info, err
    _unchanged(old, sd, names)
    mmapckpt.save({"ok": torch.ones(3)}, old)  # the refused save left the directory unlocked


def test_tensors_that_are_plain_underneath_are_saved(tmp_path):
    """Not refused: parameters, a subclass without its own dispatch, conjugate and negative views, 0-d, empty."""
    class Tagged(torch.Tensor):
        pass

    z = torch.randn(3, dtype=torch.complex64)
    sd = {"param": torch.nn.Parameter(torch.randn(2, 3)), "tagged": torch.randn(4).as_subclass(Tagged),
          "conj": z.conj(), "neg": z.conj().imag, "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 3),
          "buffer": torch.nn.Buffer(torch.ones(2))}
    for api in ("save", "dcp"):
        path = str(tmp_path / api)
        if api == "save":
            mmapckpt.save(sd, path)
        else:
            dcp.save(sd, storage_writer=MmapWriter(path), no_dist=True)
        got = mmapckpt.load(path)
        assert set(got) == set(sd)
        for k, v in sd.items():
            assert got[k].dtype == v.dtype and tensor_bytes(got[k]) == tensor_bytes(v), k


def test_any_other_failure_to_take_a_tensors_bytes_is_a_checkpoint_write_error(tmp_path):
    """What the checks above do not foresee (here a planner whose resolve_data raises) still arrives typed,
    naming the shard file, with the temp file removed and the old checkpoint unchanged."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    class Broken(DefaultSavePlanner):
        def resolve_data(self, write_item):
            if write_item.index.fqn == "b":
                raise RuntimeError("the planner could not produce this tensor")
            return super().resolve_data(write_item)

    old = str(tmp_path / "old")
    sd = _old(old)
    names = sorted(os.listdir(old))
    with pytest.raises(BaseException) as info:
        dcp.save({"a": torch.ones(3), "b": torch.ones(3)}, storage_writer=MmapWriter(old), planner=Broken(),
                 no_dist=True)
    err = dcp_failure(info.value)
    assert isinstance(err, CheckpointWriteError), f"{type(err).__name__}: {err}"
    assert "could not produce this tensor" in str(err) and err.path.startswith(os.path.join(old, "__0_0"))
    del info, err
    _unchanged(old, sd, names)


def test_mmapckpt_save_checks_each_tensor_once(monkeypatch, tmp_path):
    """mmapckpt.save checks every tensor before it writes (above) and tells the shard writer so, which
    then does not check them again; dcp.save's planners get the writer's check."""
    from mmapckpt.dcp import storable

    calls: list[str] = []
    real = storable.unstorable
    monkeypatch.setattr(storable, "unstorable", lambda t: calls.append("x") or real(t))
    mmapckpt.save({"a": torch.ones(2), "b": torch.zeros(3)}, tmp_path / "c")
    assert len(calls) == 2
    calls.clear()
    dcp.save({"a": torch.ones(2), "b": torch.zeros(3)}, storage_writer=MmapWriter(tmp_path / "d"), no_dist=True)
    assert len(calls) == 2  # the writer's check, through DCP's default planner
