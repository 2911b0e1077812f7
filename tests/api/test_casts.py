"""Which casts a load refuses (format/casts.py, docs/lazy.md "Casts"), through every entry point that casts.

Rounding is a cast's purpose and passes; a value the target dtype cannot hold (an integer outside its
range, a finite float past its largest finite value) and a change of kind (complex into real) raise
``CastError`` naming the file and the entry, before anything is written, unless ``allow_cast=True``,
which gives torch's cast bit for bit.
"""

from __future__ import annotations

import os

import pytest
import torch
from helpers import assert_bitwise_equal
from torch import nn

import mmapckpt
from mmapckpt import CastError, CheckpointError
from mmapckpt.format.casts import out_of_range, range_can_shrink
from mmapckpt.tools.cli import main

pytestmark = pytest.mark.filterwarnings("ignore:ComplexHalf support:UserWarning",
                                        "ignore:Casting complex values to real:UserWarning")

F32_MAX = torch.finfo(torch.float32).max

# (stored values, target dtype): refused
REFUSED = [
    (torch.tensor([1, 1000], dtype=torch.int64), torch.int8),  # 1000 would wrap to -24
    (torch.tensor([-1, 5], dtype=torch.int32), torch.uint8),  # -1 would become 255
    (torch.tensor([0, 2], dtype=torch.int64), torch.bool),  # 2 would become True
    (torch.tensor([70000], dtype=torch.int32), torch.float16),  # inf
    (torch.tensor([1.0, 1e30]), torch.float16),  # inf
    (torch.tensor([-1e30, float("inf"), float("nan")]), torch.float16),  # inf and NaN pass, -1e30 does not
    (torch.tensor([F32_MAX]), torch.bfloat16),  # rounds past bfloat16's largest finite value
    (torch.tensor([1e300], dtype=torch.float64), torch.float32),
    (torch.tensor([500.0]), torch.float8_e4m3fn),  # no inf in this float8: it would saturate
    (torch.tensor([1 + 1e30j], dtype=torch.complex64), torch.complex32),  # the imaginary part overflows
]
# kept: every value is its own rounding
KEPT = [
    (torch.tensor([-128, 127], dtype=torch.int64), torch.int8),
    (torch.tensor([0, 1], dtype=torch.int64), torch.bool),
    (torch.tensor([1.0, -65504.0, 65519.0, float("inf"), float("-inf"), float("nan"), 1e-30]), torch.float16),
    (torch.tensor([2 ** 60], dtype=torch.int64), torch.float32),  # rounded, in range
    (torch.tensor([1.0, 3.0e38]), torch.bfloat16),
    (torch.tensor([448.0, 460.0]), torch.float8_e4m3fn),  # 460 rounds to 448
    (torch.tensor([1 + 2j], dtype=torch.complex128), torch.complex64),
]


def _torch_cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(t.shape, dtype=dtype).copy_(t)


@pytest.mark.parametrize("values, dtype", REFUSED, ids=lambda x: str(x) if isinstance(x, torch.dtype) else "")
def test_load_into_refuses_values_the_target_cannot_hold(tmp_path, values, dtype) -> None:
    mmapckpt.save({"x": values, "ok": torch.ones(3)}, tmp_path / "c")
    target, other = torch.zeros(values.shape, dtype=dtype), torch.zeros(3)
    with pytest.raises(CastError, match=r"allow_cast=True") as e:
        mmapckpt.load_into({"ok": other, "x": target}, tmp_path / "c")
    assert isinstance(e.value, TypeError) and isinstance(e.value, CheckpointError)
    assert e.value.entry == "x" and e.value.path == os.fspath(tmp_path / "c")
    assert not other.any() and not target.view(torch.uint8).any()  # nothing written: checked before any fill
    mmapckpt.load_into({"ok": other, "x": target}, tmp_path / "c", allow_cast=True)
    assert_bitwise_equal(target, _torch_cast(values, dtype))


@pytest.mark.parametrize("values, dtype", KEPT, ids=lambda x: str(x) if isinstance(x, torch.dtype) else "")
def test_load_into_keeps_rounding(tmp_path, values, dtype) -> None:
    mmapckpt.save({"x": values}, tmp_path / "c")
    target = torch.zeros(values.shape, dtype=dtype)
    mmapckpt.load_into({"x": target}, tmp_path / "c")
    assert_bitwise_equal(target, _torch_cast(values, dtype))


def test_the_message_says_what_the_cast_would_give(tmp_path) -> None:
    mmapckpt.save({"x": torch.tensor([1000])}, tmp_path / "c")
    with pytest.raises(CastError, match=r"entry 'x'.*1000, outside torch.int8's range.*-128 to 127.*give -24"):
        mmapckpt.load_into({"x": torch.zeros(1, dtype=torch.int8)}, tmp_path / "c")


def test_range_checks_only_where_a_value_can_fall_outside() -> None:
    assert not range_can_shrink(torch.int8, torch.int64)
    assert not range_can_shrink(torch.float16, torch.float32)
    assert not range_can_shrink(torch.int64, torch.bfloat16)  # int64's largest is far inside bfloat16's
    assert range_can_shrink(torch.float32, torch.bfloat16)
    assert range_can_shrink(torch.uint8, torch.int8)


def test_a_big_tensor_is_checked_in_pieces() -> None:
    """The one offending value sits in the last piece of a tensor longer than one piece."""
    t = torch.zeros((1 << 24) + 5)
    assert out_of_range(t, torch.float16) is None
    t[-1] = float("nan")
    t[-2] = 1e6
    assert "1000000.0" in out_of_range(t, torch.float16)


def test_load_dtype_refuses_values_outside_its_range(tmp_path) -> None:
    mmapckpt.save({"big": torch.tensor([1.0, 1e30]), "ok": torch.tensor([2.5])}, tmp_path / "c")
    with pytest.raises(CastError, match=r"entry 'big'.*allow_cast=True"):
        mmapckpt.load(tmp_path / "c", dtype=torch.float16)
    sd = mmapckpt.load(tmp_path / "c", dtype=torch.float16, allow_cast=True)
    assert_bitwise_equal(sd["big"], torch.tensor([1.0, float("inf")], dtype=torch.float16))
    assert_bitwise_equal(mmapckpt.load(tmp_path / "c", keys=["ok"], dtype=torch.float16)["ok"],
                         torch.tensor([2.5], dtype=torch.float16))


class _One(nn.Module):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(2, dtype=dtype), requires_grad=False)
        self.b = nn.Parameter(torch.zeros(2))


@pytest.mark.parametrize("on_meta", [True, False])
@pytest.mark.parametrize("stored, dtype", [
    (torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64), torch.float32),  # the imaginary part dropped
    (torch.tensor([1.0, 1e30]), torch.float16),
    (torch.tensor([1.5, 2.5]), torch.int32),
])
def test_load_model_refuses_on_meta_and_in_memory(tmp_path, on_meta, stored, dtype) -> None:
    mmapckpt.save({"w": stored, "b": torch.ones(2)}, tmp_path / "c")
    if on_meta:
        with torch.device("meta"):
            model = _One(dtype)
    else:
        model = _One(dtype)
    with pytest.raises(CastError, match=r"entry 'w'.*allow_cast=True"):
        mmapckpt.load_model(model, tmp_path / "c")
    # nothing changed: still on meta, or still zero
    assert model.w.is_meta == on_meta and model.b.is_meta == on_meta
    if not on_meta:
        assert not model.w.view(torch.uint8).any() and not model.b.any()
    mmapckpt.load_model(model, tmp_path / "c", allow_cast=True)
    assert_bitwise_equal(model.w.detach(), stored.to(dtype) if not stored.is_complex() else stored.real.to(dtype))


def test_load_model_casts_within_range_on_meta(tmp_path) -> None:
    stored = torch.tensor([-3.0e38, float("nan")])
    mmapckpt.save({"w": stored, "b": torch.ones(2)}, tmp_path / "c")
    with torch.device("meta"):
        model = _One(torch.bfloat16)
    mmapckpt.load_model(model, tmp_path / "c")
    assert_bitwise_equal(model.w.detach(), stored.to(torch.bfloat16))


@pytest.mark.parametrize("call", [lambda p: mmapckpt.load_model(nn.Linear(1, 1), p, device="meta"),
                                  lambda p: mmapckpt.load(p, device="meta"),
                                  lambda p: mmapckpt.open(p, device="meta")])
def test_the_meta_device_is_refused_truthfully(tmp_path, call) -> None:
    mmapckpt.save({"weight": torch.ones(1, 1), "bias": torch.ones(1)}, tmp_path / "c")
    with pytest.raises(ValueError, match="device 'meta' holds no data") as e:
        call(tmp_path / "c")
    assert "install" not in str(e.value) and "build" not in str(e.value)


def test_convert_dtype_refuses_values_outside_its_range(tmp_path) -> None:
    mmapckpt.save({"big": torch.tensor([1.0, 1e30]), "ok": torch.tensor([2.5])}, tmp_path / "c")
    out = tmp_path / "out.safetensors"
    with pytest.raises(CastError, match=r"entry 'big'.*allow_cast=True") as e:
        mmapckpt.convert(tmp_path / "c", out, dtype="fp16")
    assert e.value.path == os.fspath(tmp_path / "c")
    assert not out.exists()
    assert main(["convert", str(tmp_path / "c"), str(out), "--dtype", "fp16", "-q"]) != 0
    assert not out.exists()
    assert main(["convert", str(tmp_path / "c"), str(out), "--dtype", "fp16", "--allow-cast", "-q"]) == 0
    sd = mmapckpt.load(out)
    assert_bitwise_equal(sd["big"], torch.tensor([1.0, float("inf")], dtype=torch.float16))
    mmapckpt.convert(tmp_path / "c", tmp_path / "bf16", dtype="bf16")  # within range: converted
    assert_bitwise_equal(mmapckpt.load(tmp_path / "bf16")["big"], torch.tensor([1.0, 1e30]).to(torch.bfloat16))


def test_load_into_checks_each_piece_as_it_copies(tmp_path) -> None:
    # the check runs as the values are copied, a piece (2**20 elements) at a time: a value outside the target's
    # range in the last piece is found there; targets that need no check are filled after, so they stay unwritten
    big = torch.zeros((1 << 20) + 5)
    big[-1] = 1e30
    mmapckpt.save({"big": big, "ok": torch.ones(3)}, tmp_path / "c")
    target, other = torch.zeros(big.shape, dtype=torch.float16), torch.zeros(3)
    with pytest.raises(CastError, match=r"e\+30, outside") as e:
        mmapckpt.load_into({"ok": other, "big": target}, tmp_path / "c")
    assert e.value.entry == "big"
    assert not other.any()
    big[-1] = -65504.0
    mmapckpt.save({"big": big, "ok": torch.ones(3)}, tmp_path / "d")
    mmapckpt.load_into({"ok": other, "big": target}, tmp_path / "d")
    assert_bitwise_equal(target, _torch_cast(big, torch.float16))
    assert_bitwise_equal(other, torch.ones(3))


def test_load_model_checks_every_value_before_it_changes_the_model(tmp_path) -> None:
    # two in-place targets whose values are checked: the first fits, the second does not; load_model's refusal
    # must leave both as they were (load_into's one-pass check would have written the first)
    mmapckpt.save({"a": torch.tensor([1.0, 2.0]), "z": torch.tensor([1.0, 1e30])}, tmp_path / "c")
    model = nn.Module()
    model.register_buffer("a", torch.zeros(2, dtype=torch.float16))
    model.register_buffer("z", torch.zeros(2, dtype=torch.float16))
    with pytest.raises(CastError, match=r"entry 'z'"):
        mmapckpt.load_model(model, tmp_path / "c")
    assert not model.a.any() and not model.z.any()
