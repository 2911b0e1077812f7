"""``mmapckpt.open`` against ``safetensors.safe_open`` (0.8): the same calls on the same file, compared.

Every public method of safe_open's handle and of its slices is called through both, for
the torch and the numpy frameworks, and the results are compared by type and by value
(bitwise); where safetensors fails (numpy has no bfloat16 or float8: TypeError, and an
AttributeError from numpy for float8), mmapckpt raises TypeError naming the entry and its dtype.
"""

from __future__ import annotations

import numpy as np
import pytest
import safetensors
import torch
from safetensors.torch import save_file

import mmapckpt

TENSORS = {
    "w.f32": torch.arange(24, dtype=torch.float32).reshape(4, 6) - 7.5,
    "w.bf16": torch.randn(3, 5, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16),
    "w.f16": torch.tensor([-0.0, 1.5, float("nan")], dtype=torch.float16),
    "w.f64": torch.linspace(-1, 1, 7, dtype=torch.float64),
    "i.i64": torch.arange(10, dtype=torch.int64).reshape(2, 5),
    "i.i8": torch.tensor([-128, 0, 127], dtype=torch.int8),
    "i.u8": torch.tensor([0, 255], dtype=torch.uint8),
    "b.bool": torch.tensor([True, False, True]),
    "f8.e4m3": torch.tensor([0.5, -2.0], dtype=torch.float8_e4m3fn),
    "scalar": torch.tensor(3.0),
    "empty": torch.zeros(0, 4),
}
NO_NUMPY = {"w.bf16", "f8.e4m3"}
INDEXES = [(slice(None),), (slice(1, 3),), (0,), (slice(None), slice(2, 5)), (Ellipsis,), (-1,),
           (slice(0, 1), slice(None, None, 2))]


@pytest.fixture(scope="module", params=[{"format": "pt", "step": "9"}, None], ids=["metadata", "no-metadata"])
def file(request, tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("st") / "model.safetensors")
    save_file(TENSORS, path, metadata=request.param)
    return path


def _same(a, b) -> None:
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.reshape(-1).contiguous().view(torch.uint8),
                           b.reshape(-1).contiguous().view(torch.uint8))  # bitwise
    else:
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def test_handle_methods_exist_with_their_return_types(file) -> None:
    public = {m for m in dir(safetensors.safe_open) if not m.startswith("_")}
    assert public == {"get_slice", "get_tensor", "get_tensors", "keys", "metadata", "offset_keys"}
    with safetensors.safe_open(file, "pt") as s, mmapckpt.open(file, "pt") as f:
        for m in public:
            assert hasattr(f, m), m
        assert f.keys() == s.keys() and f.offset_keys() == s.offset_keys()
        assert f.metadata() == s.metadata()
        got, want = f.get_tensors(), s.get_tensors()
        assert list(got) == list(want)
        for n in want:
            _same(got[n], want[n])


@pytest.mark.parametrize("framework", ["pt", "numpy", "np"])
def test_same_calls_same_results(file, framework) -> None:
    with safetensors.safe_open(file, framework) as s, mmapckpt.open(file, framework) as f:
        for name in s.keys():
            ss, fs = s.get_slice(name), f.get_slice(name)
            assert fs.get_dtype() == ss.get_dtype() and type(fs.get_dtype()) is str
            assert fs.get_shape() == ss.get_shape() and type(fs.get_shape()) is list
            if framework != "pt" and name in NO_NUMPY:
                with pytest.raises((TypeError, AttributeError)):  # safetensors: AttributeError for float8
                    s.get_tensor(name)
                with pytest.raises(TypeError, match=f"entry '{name}' is {ss.get_dtype()}.*numpy has no dtype"):
                    f.get_tensor(name)
                with pytest.raises(TypeError, match=f"entry '{name}'"):
                    fs[:]
                continue
            _same(f.get_tensor(name), s.get_tensor(name))
            for index in INDEXES if ss.get_shape() else []:
                try:
                    want = ss[index]
                except Exception:  # an index safetensors refuses (past the rank): not compared
                    continue
                _same(fs[index], want)


def test_dtype_codes_are_safetensors_names(file) -> None:
    with mmapckpt.open(file) as f:
        assert f.get_slice("w.bf16").get_dtype() == "BF16" and f.get_slice("w.bf16").dtype == torch.bfloat16
        assert f.get_slice("f8.e4m3").get_dtype() == "F8_E4M3"


def test_numpy_arrays_share_the_mapping(file) -> None:
    with mmapckpt.open(file, "numpy") as f:
        a = f.get_tensor("w.f32")
    assert isinstance(a, np.ndarray) and not a.flags.owndata
    np.testing.assert_array_equal(a, TENSORS["w.f32"].numpy())


def test_numpy_on_another_device_refused(file) -> None:
    with pytest.raises(ValueError, match="numpy arrays, which live on the CPU"):
        mmapckpt.open(file, "numpy", device="meta")
