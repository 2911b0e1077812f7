"""The usual mistakes with the single-process API get a message that says what to do."""

from __future__ import annotations

import pytest
import torch

import helpers
import mmapckpt


@pytest.fixture
def ckpt(tmp_path):
    sd = {"w": torch.tensor([1.75, -2.5, 3.25]), "z": torch.tensor([1 + 2j], dtype=torch.complex64),
          "i": torch.arange(3, dtype=torch.int64)}
    mmapckpt.save(sd, tmp_path / "c")
    return sd, tmp_path / "c"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message where CUDA is missing")
def test_load_to_an_unavailable_device_says_so_before_any_work(ckpt):
    _, path = ckpt
    with pytest.raises(RuntimeError, match="device 'cuda' is not available in this process"):
        mmapckpt.load(path, device="cuda")


def test_load_into_meta_tensors_is_refused_and_points_to_assign(ckpt):
    _, path = ckpt
    with torch.device("meta"):
        targets = {"w": torch.empty(3)}
    with pytest.raises(ValueError, match=r"'w' .*meta device.*assign=True"):
        mmapckpt.load_into(targets, path)


@pytest.mark.parametrize("name, dtype", [("w", torch.int32), ("w", torch.bool), ("z", torch.float32),
                                         ("z", torch.int64)])
def test_load_into_refuses_casts_that_lose_the_values(ckpt, name, dtype):
    sd, path = ckpt
    target = torch.zeros(sd[name].shape, dtype=dtype)
    with pytest.raises(TypeError, match=rf"entry '{name}'.*allow_cast=True"):
        mmapckpt.load_into({name: target}, path)
    assert not target.view(torch.uint8).any()  # nothing was written
    mmapckpt.load_into({name: target}, path, allow_cast=True)
    helpers.assert_bitwise_equal(target, torch.zeros_like(target).copy_(sd[name]))


@pytest.mark.parametrize("name, dtype", [("w", torch.float64), ("w", torch.bfloat16), ("i", torch.float32),
                                         ("z", torch.complex128)])
def test_load_into_keeps_casts_that_keep_the_kind_of_value(ckpt, name, dtype):
    sd, path = ckpt
    target = torch.zeros(sd[name].shape, dtype=dtype)
    mmapckpt.load_into({name: target}, path)
    helpers.assert_bitwise_equal(target, torch.zeros_like(target).copy_(sd[name]))
