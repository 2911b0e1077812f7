"""writing/tensors.py tensor_bytes: a tensor's bytes in C order, whatever its dtype, layout or flags."""

from __future__ import annotations

import pytest
import torch

from mmapckpt.writing.tensors import tensor_bytes as _tensor_bytes
from mmapckpt.format.dtypes import DTYPES

_ALL = sorted({d for d, _ in DTYPES.values()}, key=str)  # every dtype a shard can hold


def _reference(t: torch.Tensor) -> bytes:
    """The bytes torch itself stores for a contiguous copy (no numpy, no views of ours)."""
    c = t.detach().resolve_conj().resolve_neg().contiguous().clone()
    return bytes(c.view(-1).view(torch.uint8).tolist()) if c.numel() else b""


def _make(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    raw = torch.arange(max(1, torch.Size(shape).numel()) * dtype.itemsize, dtype=torch.int64) * 37 + 11
    raw = raw.to(torch.uint8) & (1 if dtype == torch.bool else 255)  # a bool byte is 0 or 1
    return raw.view(dtype)[:torch.Size(shape).numel()].view(shape)


@pytest.mark.parametrize("dtype", _ALL, ids=str)
def test_every_dtype_gives_its_stored_bytes(dtype: torch.dtype) -> None:
    for shape in [(3, 5), (7,), (), (1,), (0, 2)]:
        t = _make(dtype, shape)
        assert bytes(_tensor_bytes(t)) == _reference(t)
        if t.dim() == 2:
            assert bytes(_tensor_bytes(t.t())) == _reference(t.t())  # not contiguous


def test_flags_that_change_the_values_are_resolved() -> None:
    z = torch.complex(torch.arange(6.0), torch.ones(6)).view(2, 3)
    assert bytes(_tensor_bytes(z.conj())) == _reference(z.conj())
    p = torch.nn.Parameter(torch.arange(6.0).view(2, 3))
    assert bytes(_tensor_bytes(p)) == _reference(p)
    assert bytes(_tensor_bytes(torch.arange(4.0).view(2, 2).neg()._neg_view())) == _reference(
        torch.arange(4.0).view(2, 2).neg()._neg_view())
