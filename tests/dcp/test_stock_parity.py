"""Stock parity in one process: what PyTorch's own filesystem checkpoint tests check, stock and ours as peers.

PyTorch's test/distributed/checkpoint/test_file_system_checkpoint.py and ``_cpu.py`` check
FileSystemWriter/FileSystemReader for: tensors only under several ``thread_count`` values and
``single_file_per_rank`` settings, tensors and non-tensor blobs (a Stateful holding bytes,
lists, strings) together, also through stream transforms (one of their own, ZStandard),
loads into targets of another dtype (cast), overwrite, and loads whose state dict lists its
keys in another order than the save's. The same behaviours are written here independently,
with a few neighbours (a module's parameters loaded in place, non-contiguous targets, an
empty state dict, some keys only), and each is run with every writer/reader pair:
stock/stock (the reference), mmap/mmap, and stock writer with MmapReader (MmapReader reads
stock checkpoints; the stock reader cannot read ours). Every load target starts as the
bitwise complement of the saved value, so a byte a load fails to write shows up, and
results are compared byte for byte (NaN payloads, -0.0, bf16, fp8). The multi-rank
behaviours (ShardedTensor, DTensor, resharding on load) are in
tests/distributed/test_stock_parity_dist.py.
"""

from __future__ import annotations

import io
import os
import tempfile
import zlib
from itertools import product
from typing import Any

import pytest
import torch
from helpers import (
    Invert,
    assert_tree_equal,
    dcp_failure,
    dcp_load,
    dcp_save,
    invert_registry,
    tensor_bytes,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from strategies import tensor_from_bytes
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._extension import ZStandard
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.stateful import Stateful

import mmapckpt

WRITERS: dict[str, Any] = {"stock": FileSystemWriter, "mmap": mmapckpt.MmapWriter}
READERS: dict[str, Any] = {"stock": FileSystemReader, "mmap": mmapckpt.MmapReader}
#: (writer, reader): the stock pair is the reference; the stock reader cannot read mmapckpt files.
PAIRS = [("stock", "stock"), ("mmap", "mmap"), ("stock", "mmap")]
PAIR_IDS = [f"{w}-writer-{r}-reader" for w, r in PAIRS]


def _writer(kind: str, path: Any, **kw: Any) -> Any:
    return WRITERS[kind](path, **kw)


def _reader(kind: str, path: Any, thread_count: int = 1, **kw: Any) -> Any:
    if kind == "mmap":
        return mmapckpt.MmapReader(path, thread_count=thread_count, **kw)
    return FileSystemReader(path, **kw)  # the stock reader has no thread_count


# ---------------------------------------------------------------------------- test data
def value(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Seeded random bytes viewed as ``dtype``; float ones hold -0.0 and NaNs with odd payloads."""
    size = dtype.itemsize
    numel = 1
    for s in shape:
        numel *= s
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    raw = bytearray(torch.randint(0, 256, (numel * size,), dtype=torch.uint8, generator=g).numpy().tobytes())
    if dtype.is_floating_point or dtype.is_complex:
        specials = [bytes(size - 1) + b"\x80", b"\xff" * size, b"\x01" + b"\xff" * (size - 2) + b"\x7f"
                    if size > 1 else b"\x7f"]  # -0.0, a negative NaN, a positive NaN with a small payload
        for j, pat in enumerate(specials[:numel]):
            raw[j * size:(j + 1) * size] = pat
    return tensor_from_bytes(bytes(raw), dtype, shape)


def complement(t: torch.Tensor) -> torch.Tensor:
    """Same dtype and shape, every byte different (bool: the negation)."""
    if t.dtype == torch.bool:
        return ~t
    flat = t.detach().clone(memory_format=torch.contiguous_format).reshape(-1).view(torch.uint8)
    return (flat ^ 0xFF).view(t.dtype).reshape(t.shape)


def _transposed(name: str) -> torch.Tensor:
    return value(name, (6, 4), torch.float16).t()  # a non-contiguous source


#: Twelve tensors in the order they are taken: the stock tests' module (two Linears and an
#: EmbeddingBag) first, then other dtypes, a 0-d, an empty and a non-contiguous tensor.
CATALOGUE: list[tuple[str, Any]] = [
    ("linear_1.weight", lambda n: value(n, (5, 5), torch.float32)),
    ("emb.weight", lambda n: value(n, (5, 10), torch.float32)),
    ("linear_1.bias", lambda n: value(n, (5,), torch.float32)),
    ("linear_2.weight", lambda n: value(n, (1, 5), torch.float32)),
    ("linear_2.bias", lambda n: value(n, (1,), torch.float32)),
    ("bf16", lambda n: value(n, (7, 3), torch.bfloat16)),
    ("fp8", lambda n: value(n, (4, 4), torch.float8_e4m3fn)),
    ("empty", lambda n: value(n, (0, 3), torch.int64)),
    ("mask", lambda n: value(n, (3, 5), torch.bool)),
    ("cplx", lambda n: value(n, (3,), torch.complex64)),
    ("scalar", lambda n: value(n, (), torch.float64)),
    ("transposed", _transposed),
]


def tensors(n: int) -> dict[str, torch.Tensor]:
    return {name: make(name) for name, make in CATALOGUE[:n]}


def targets(sd: Any) -> Any:
    """Load targets for ``sd``: tensors complemented (contiguous), containers copied, other values as given."""
    if isinstance(sd, torch.Tensor):
        return complement(sd)
    if isinstance(sd, dict):
        return {k: targets(v) for k, v in sd.items()}
    if isinstance(sd, list):
        return [targets(v) for v in sd]
    return sd


def _distcp(path: Any) -> list[str]:
    return sorted(n for n in os.listdir(path) if n.endswith(".distcp"))


def _assert_all_bytes_differ(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    for k, t in a.items():
        if t.numel():
            assert all(x != y for x, y in zip(tensor_bytes(t), tensor_bytes(b[k]))), k


# ---------------------------------------------------------------------------- tensors only
@pytest.mark.parametrize("pair", PAIRS, ids=PAIR_IDS)
@pytest.mark.parametrize("single_file_per_rank", [True, False], ids=["one-file-per-rank", "one-file-per-item"])
@pytest.mark.parametrize("thread_count", [1, 2, 3])
@pytest.mark.parametrize("n", [2, 12], ids=["2-tensors", "12-tensors"])
def test_tensors_only(tmp_path: Any, pair: tuple[str, str], single_file_per_rank: bool, thread_count: int,
                      n: int) -> None:
    """Threads and files: 3 threads for 2 tensors (more threads than items) and 12 tensors over
    1-3 threads (more items than threads), one file per rank's bucket or one per item."""
    w, r = pair
    sd = tensors(n)
    dcp_save(sd, _writer(w, tmp_path, thread_count=thread_count, single_file_per_rank=single_file_per_rank))
    files = _distcp(tmp_path)
    if single_file_per_rank:
        # a file per thread's bucket; with fewer items than threads the stock writer also writes empty ones
        assert min(thread_count, n) <= len(files) <= thread_count, files
    else:
        assert len(files) == n, files
    loaded = targets(sd)
    _assert_all_bytes_differ(loaded, sd)
    dcp_load(loaded, _reader(r, tmp_path, thread_count))
    assert_tree_equal(loaded, sd)


@pytest.mark.parametrize("pair", PAIRS, ids=PAIR_IDS)
def test_one_tensor_spread_over_more_threads_than_items(tmp_path: Any, pair: tuple[str, str]) -> None:
    w, r = pair
    sd = {"only": value("only", (33, 7), torch.bfloat16)}
    dcp_save(sd, _writer(w, tmp_path, thread_count=4))
    loaded = targets(sd)
    dcp_load(loaded, _reader(r, tmp_path, 4))
    assert_tree_equal(loaded, sd)


class Module(torch.nn.Module):
    """The stock tests' module: two Linears and an EmbeddingBag."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.linear_1 = torch.nn.Linear(5, 5)
        self.linear_2 = torch.nn.Linear(5, 1)
        self.emb = torch.nn.EmbeddingBag(5, 10)
        with torch.no_grad():
            for name, p in self.named_parameters():
                p.copy_(value(f"module{seed}.{name}", tuple(p.shape), p.dtype))


@pytest.mark.parametrize("pair", PAIRS, ids=PAIR_IDS)
def test_module_parameters_load_in_place(tmp_path: Any, pair: tuple[str, str]) -> None:
    """Parameters (requires_grad) saved from one module load into another's, in place."""
    w, r = pair
    src, dst = Module(1), Module(2)
    dcp_save(dict(src.named_parameters()), _writer(w, tmp_path))
    target = dict(dst.named_parameters())
    ptrs = {k: p.data_ptr() for k, p in target.items()}
    dcp_load(target, _reader(r, tmp_path))
    assert {k: p.data_ptr() for k, p in dst.named_parameters()} == ptrs
    assert_tree_equal({k: p.detach() for k, p in dst.named_parameters()},
                      {k: p.detach() for k, p in src.named_parameters()})
    md = _reader(r, tmp_path).read_metadata().state_dict_metadata
    assert all(md[k].properties.requires_grad for k in target)


@pytest.mark.parametrize("pair", PAIRS, ids=PAIR_IDS)
def test_non_contiguous_targets_are_filled_in_place(tmp_path: Any, pair: tuple[str, str]) -> None:
    w, r = pair
    sd = {"a": value("nc.a", (5, 7), torch.float32), "b": value("nc.b", (3, 8), torch.bfloat16)}
    dcp_save(sd, _writer(w, tmp_path))
    base_a, base_b = complement(sd["a"]).t().contiguous(), torch.zeros(3, 16, dtype=torch.bfloat16)
    target = {"a": base_a.t(), "b": base_b[:, ::2]}
    dcp_load(target, _reader(r, tmp_path))
    assert_tree_equal(target, sd)
    assert_tree_equal({"a": base_a.t(), "b": base_b[:, ::2]}, sd)  # the storage the views share
    assert not bool(base_b[:, 1::2].view(torch.int16).any()), "bytes between the strided elements changed"


@pytest.mark.parametrize("pair", PAIRS, ids=PAIR_IDS)
def test_empty_state_dict(tmp_path: Any, pair: tuple[str, str]) -> None:
    w, r = pair
    dcp_save({}, _writer(w, tmp_path))
    assert _reader(r, tmp_path).read_metadata().state_dict_metadata == {}
    assert dcp_load({}, _reader(r, tmp_path)) == {}


# ---------------------------------------------------------------------------- tensors and blobs
class Blob(Stateful):
    """A Stateful holding bytes, a count and a tensor, as the stock tests' BlobState holds bytes."""

    def __init__(self, payload: bytes, count: int, weights: torch.Tensor) -> None:
        self.state: dict[str, Any] = {"payload": payload, "count": count, "weights": weights}

    def state_dict(self) -> dict[str, Any]:
        return self.state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.state = state_dict


def _with_blobs(placeholders: bool) -> dict[str, Any]:
    """Tensors and non-tensor values together; ``placeholders``: the load side's different values."""
    t = tensors(3)
    if placeholders:
        t = targets(t)
    w = value("blob.weights", (2, 3), torch.float16)
    m = value("nested.mixed.0", (4,), torch.bfloat16)
    return {
        **t,
        "bytes_io": io.BytesIO(b"" if placeholders else b"\x00SomeBlobForTesting\xff" * 3),
        "step": -1 if placeholders else 1234,
        "name": "" if placeholders else "run-7",
        "lr": 0.0 if placeholders else 3e-4,
        "raw": b"" if placeholders else b"\x00\x01raw bytes\xfe",
        "nothing": "placeholder" if placeholders else None,
        "nested": {
            "betas": (0.0, 0.0) if placeholders else (0.9, 0.95),
            "values": [0, "", {"three": 0.0, "four": [0, 0]}] if placeholders else [1, "two", {"three": 3.0, "four": [4, 4]}],
            "mixed": [complement(m) if placeholders else m, 0 if placeholders else 5, "" if placeholders else "x"],
            "deeper": {"t": complement(t["emb.weight"]) if placeholders else t["emb.weight"].clone()},
        },
        "blob": Blob(b"", 0, complement(w)) if placeholders else Blob(b"SomeBlobForTesting", 3, w),
    }


def _comparable(v: Any) -> Any:
    """BytesIO and Stateful values as comparable data (neither defines ==)."""
    if isinstance(v, io.BytesIO):
        return ("BytesIO", v.getvalue())
    if isinstance(v, Blob):
        return ("Blob", _comparable(v.state_dict()))
    if isinstance(v, dict):
        return {k: _comparable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return type(v)(_comparable(x) for x in v)
    return v


@pytest.mark.parametrize("pair", PAIRS, ids=PAIR_IDS)
@pytest.mark.parametrize("thread_count", [1, 2])
def test_tensors_and_blobs(tmp_path: Any, pair: tuple[str, str], thread_count: int) -> None:
    w, r = pair
    dcp_save(_with_blobs(False), _writer(w, tmp_path, thread_count=thread_count))
    loaded = _with_blobs(True)
    dcp_load(loaded, _reader(r, tmp_path, thread_count))
    assert_tree_equal(_comparable(loaded), _comparable(_with_blobs(False)))


TRANSFORMS = {
    "own-transform": (lambda: [Invert()], invert_registry),
    "zstd": (lambda: [ZStandard()], lambda: None),  # found in DCP's default registry
}


@pytest.mark.parametrize("pair", PAIRS, ids=PAIR_IDS)
@pytest.mark.parametrize("transform", list(TRANSFORMS))
@pytest.mark.parametrize("thread_count", [1, 2])
def test_tensors_and_blobs_through_stream_transforms(tmp_path: Any, pair: tuple[str, str], transform: str,
                                                     thread_count: int) -> None:
    """As the stock tests run tensors and a Stateful blob through a transform of their own and ZStandard."""
    if transform == "zstd" and not ZStandard.is_available():
        pytest.skip("zstandard is not installed")
    w, r = pair
    extensions, registry = TRANSFORMS[transform]
    dcp_save(_with_blobs(False), _writer(w, tmp_path, thread_count=thread_count, _extensions=extensions()))
    loaded = _with_blobs(True)
    reg = registry()
    dcp_load(loaded, _reader(r, tmp_path, thread_count, **({} if reg is None else {"_extension_registry": reg})))
    assert_tree_equal(_comparable(loaded), _comparable(_with_blobs(False)))


@pytest.mark.parametrize("pair", PAIRS, ids=PAIR_IDS)
def test_blobs_only(tmp_path: Any, pair: tuple[str, str]) -> None:
    """The stock tests' bytes case: a list and a string, no tensor at all."""
    w, r = pair
    dcp_save({"bytes0": [1], "bytes1": "string"}, _writer(w, tmp_path, thread_count=2))
    loaded: dict[str, Any] = {"bytes0": [2], "bytes1": "other"}
    dcp_load(loaded, _reader(r, tmp_path))
    assert loaded == {"bytes0": [1], "bytes1": "string"}


# ---------------------------------------------------------------------------- dtype of the targets
CASTS = [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32), (torch.float16, torch.float64),
         (torch.float32, torch.float16)]


def _cast_case(tmp_path: Any, pair: tuple[str, str], saved: torch.dtype, target: torch.dtype) -> torch.Tensor:
    w, r = pair
    path = tmp_path / f"{w}-{r}"
    src = value(f"cast.{saved}", (6, 5), saved)  # NaN payloads and infinities included
    dcp_save({"w": src}, _writer(w, path))
    loaded = {"w": torch.full((6, 5), 7.0, dtype=target)}
    dcp_load(loaded, _reader(r, path))
    return loaded["w"]


@pytest.mark.parametrize("saved, target", CASTS, ids=[f"{a}-into-{b}".replace("torch.", "") for a, b in CASTS])
def test_load_casts_into_the_targets_dtype_as_stock_does(tmp_path: Any, saved: torch.dtype,
                                                          target: torch.dtype) -> None:
    """A checkpoint loaded into targets of another float dtype: the stock pair casts (copy_); so must ours."""
    got = {pair: _cast_case(tmp_path, pair, saved, target) for pair in PAIRS}
    ref = got[PAIRS[0]]
    assert ref.dtype == target
    for pair in PAIRS[1:]:
        assert_tree_equal(got[pair], ref, f"{pair[0]}-writer-{pair[1]}-reader")


# ---------------------------------------------------------------------------- overwrite
def _version(v: int) -> dict[str, Any]:
    """Two versions of a state dict with different layouts: a shape changes, an entry goes, one comes."""
    if v == 1:
        return {"a": value("v1.a", (4, 4), torch.float32), "b": value("v1.b", (3,), torch.bfloat16),
                "gone": value("v1.gone", (5,), torch.int64), "step": 1, "tag": "first"}
    return {"a": value("v2.a", (6, 2), torch.float32), "b": value("v2.b", (3,), torch.bfloat16),
            "new": value("v2.new", (2, 2), torch.float16), "step": 2, "tag": "second"}


def _load_version(path: Any, reader: str, v: int) -> dict[str, Any]:
    want = _version(v)
    loaded = targets(want)
    loaded.update(step=0, tag="")
    dcp_load(loaded, _reader(reader, path))
    assert_tree_equal(loaded, want)
    return loaded


#: (first writer, second writer, reader); the stock reader only where the second save was stock.
OVERWRITES = [(a, b, r) for a, b in product(WRITERS, repeat=2) for r in READERS if not (b == "mmap" and r == "stock")]


@pytest.mark.filterwarnings("ignore:Detected an existing checkpoint")
@pytest.mark.parametrize("first, second, reader", OVERWRITES, ids=[f"{a}-then-{b}-{r}-reader" for a, b, r in OVERWRITES])
def test_overwrite_true_gives_the_second_state(tmp_path: Any, first: str, second: str, reader: str) -> None:
    """The first save spreads over more files (one per item, 3 threads) than the second (one file)."""
    dcp_save(_version(1), _writer(first, tmp_path, overwrite=True, thread_count=3, single_file_per_rank=False))
    dcp_save(_version(2), _writer(second, tmp_path, overwrite=True))
    md = _reader(reader, tmp_path).read_metadata()
    assert set(md.state_dict_metadata) == {"a", "b", "new", "step", "tag"}
    _load_version(tmp_path, reader, 2)


@pytest.mark.filterwarnings("ignore:Detected an existing checkpoint")
@pytest.mark.parametrize("pair", PAIRS, ids=PAIR_IDS)
def test_overwrite_with_the_same_writer_object(tmp_path: Any, pair: tuple[str, str]) -> None:
    w, r = pair
    writer = _writer(w, tmp_path, thread_count=2)
    dcp_save(_version(1), writer)
    _load_version(tmp_path, r, 1)
    dcp_save(_version(2), writer)
    _load_version(tmp_path, r, 2)


def _snapshot(path: Any) -> dict[str, bytes]:
    out = {}
    for name in sorted(os.listdir(path)):
        with open(os.path.join(path, name), "rb") as f:
            out[name] = f.read()
    return out


@pytest.mark.parametrize("first, second", list(product(WRITERS, repeat=2)),
                         ids=[f"{a}-then-{b}" for a, b in product(WRITERS, repeat=2)])
def test_overwrite_false_refuses_and_leaves_the_checkpoint(tmp_path: Any, first: str, second: str) -> None:
    dcp_save(_version(1), _writer(first, tmp_path))
    before = _snapshot(tmp_path)
    with pytest.raises((CheckpointException, RuntimeError)) as info:
        dcp_save(_version(2), _writer(second, tmp_path, overwrite=False))
    err = dcp_failure(info.value)
    assert isinstance(err, RuntimeError), repr(err)
    assert "Checkpoint already exists" in str(err)
    if second == "mmap":
        assert isinstance(err, mmapckpt.CheckpointExistsError) and isinstance(err, mmapckpt.CheckpointError)
    assert _snapshot(tmp_path) == before
    _load_version(tmp_path, "mmap", 1)
    if first == "stock":
        _load_version(tmp_path, "stock", 1)


@pytest.mark.parametrize("pair", PAIRS, ids=PAIR_IDS)
@pytest.mark.parametrize("where", ["new-dir", "empty-dir", "dir-with-other-files"])
def test_overwrite_false_saves_where_there_is_no_checkpoint(tmp_path: Any, pair: tuple[str, str], where: str) -> None:
    w, r = pair
    path = tmp_path / "ckpt"
    if where != "new-dir":
        path.mkdir()
    if where == "dir-with-other-files":
        (path / "notes.txt").write_text("not a checkpoint")
    dcp_save(_version(1), _writer(w, path, overwrite=False))
    _load_version(path, r, 1)
    if where == "dir-with-other-files":
        assert (path / "notes.txt").read_text() == "not a checkpoint"


# ---------------------------------------------------------------------------- key orders
KEYS = ["linear_1.weight", "emb.weight", "linear_1.bias", "bf16", "fp8", "step", "name", "opt"]


def _ordered(keys: list[str], inner: list[str], placeholders: bool) -> dict[str, Any]:
    """A state dict with top-level keys in ``keys``' order and the nested dict's in ``inner``'s."""
    make = dict(CATALOGUE)
    out: dict[str, Any] = {}
    for k in keys:
        if k == "step":
            out[k] = 0 if placeholders else 77
        elif k == "name":
            out[k] = "" if placeholders else "ordered"
        elif k == "opt":
            out[k] = {i: (complement if placeholders else (lambda t: t))(value(f"opt.{i}", (3, 2), torch.float32))
                      for i in inner}
        else:
            t = make[k](k)
            out[k] = complement(t) if placeholders else t
    return out


PERMUTE = settings(max_examples=8, deadline=None, derandomize=True,
                   suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@pytest.mark.parametrize("pair", PAIRS, ids=PAIR_IDS)
@PERMUTE
@given(save=st.permutations(KEYS), load=st.permutations(KEYS), inner_save=st.permutations(["m", "v", "s"]),
       inner_load=st.permutations(["m", "v", "s"]))
def test_different_key_orders(pair: tuple[str, str], save: list[str], load: list[str], inner_save: list[str],
                              inner_load: list[str]) -> None:
    w, r = pair
    with tempfile.TemporaryDirectory() as path:
        dcp_save(_ordered(save, inner_save, False), _writer(w, path, thread_count=2))
        loaded = _ordered(load, inner_load, True)
        dcp_load(loaded, _reader(r, path))
        assert list(loaded) == load  # the target keeps its own order
        assert_tree_equal(loaded, _ordered(load, inner_load, False))


@pytest.mark.parametrize("pair", PAIRS, ids=PAIR_IDS)
def test_loading_some_keys_in_another_order(tmp_path: Any, pair: tuple[str, str]) -> None:
    w, r = pair
    dcp_save(_ordered(KEYS, ["m", "v", "s"], False), _writer(w, tmp_path))
    part = ["opt", "fp8", "step", "linear_1.weight"]
    loaded = _ordered(part, ["s", "m"], True)
    dcp_load(loaded, _reader(r, tmp_path))
    assert_tree_equal(loaded, _ordered(part, ["s", "m"], False))
