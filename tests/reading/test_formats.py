"""The format table (reading/formats.py): every layout recognised the same by every entry point, a PEFT adapter
directory read by all of them, loose safetensors files read as their union, and a name in two files refused
naming both."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import assert_bitwise_equal
from safetensors.torch import save_file

import mmapckpt
from mmapckpt import CheckpointNotFoundError, FormatError, MmapReader
from mmapckpt.reading.formats import TABLE, recognise, target_family
from mmapckpt.reading.located import locate
from mmapckpt.reading.locate import detect_format, locate_checkpoint
from mmapckpt.tools.describe import inspect_checkpoint
from mmapckpt.tools.verify import verify_checkpoint

warnings.filterwarnings("ignore", "torch.distributed is disabled")


def _sd(prefix: str = "w", n: int = 2) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(len(prefix) + n)
    return {f"{prefix}.{i}": torch.randn(3, 4, generator=g) for i in range(n)}


def _dcp_load(sd: dict[str, torch.Tensor], path: str) -> dict[str, torch.Tensor]:
    """dcp.load through MmapReader; a failure raised as the typed error ``mmapckpt.checkpoint_error`` unwraps."""
    out = {k: torch.empty_like(v) for k, v in sd.items()}
    reader = MmapReader(path)
    try:
        dcp.load(out, storage_reader=reader, no_dist=True)
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        raise mmapckpt.checkpoint_error(e, reader) from None
    return out


def _every_reader(path: str, want: dict[str, torch.Tensor], tmp_path) -> None:
    """open, load, load_into, dcp.load + MmapReader, convert, inspect and verify all read ``path``
    as ``want``."""
    with mmapckpt.open(path) as f:
        assert sorted(f.keys()) == sorted(want)
        for k, v in want.items():
            assert_bitwise_equal(f.get_tensor(k), v, k)
    got = mmapckpt.load(path)
    for k, v in want.items():
        assert_bitwise_equal(got[k], v, k)
    into = {k: torch.empty_like(v) for k, v in want.items()}
    mmapckpt.load_into(into, path)
    for k, v in want.items():
        assert_bitwise_equal(into[k], v, k)
    for k, v in _dcp_load(want, path).items():
        assert_bitwise_equal(v, want[k], k)
    out = str(tmp_path / "converted.safetensors")
    r = mmapckpt.convert(path, out)
    assert r.source_format == "safetensors" and r.tensors == len(want)
    with mmapckpt.open(out) as f:
        for k, v in want.items():
            assert_bitwise_equal(f.get_tensor(k), v, k)
    info = inspect_checkpoint(path)
    assert info.format == "safetensors" and sorted(e.name for e in info.entries) == sorted(want)
    assert verify_checkpoint(path).ok


def test_a_peft_adapter_directory_is_read_by_every_entry_point(tmp_path) -> None:
    d = tmp_path / "lora"
    d.mkdir()
    sd = {"base_model.model.q_proj.lora_A.weight": torch.randn(4, 16),
          "base_model.model.q_proj.lora_B.weight": torch.randn(16, 4)}
    save_file(sd, str(d / "adapter_model.safetensors"))
    (d / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4}))
    assert recognise(locate(str(d))).name == "safetensors-dir"
    _every_reader(str(d), sd, tmp_path)


def test_files_with_disjoint_names_read_as_their_union(tmp_path) -> None:
    d = tmp_path / "loose"
    d.mkdir()
    a, b = _sd("a"), _sd("b", 3)
    save_file(a, str(d / "part-a.safetensors"))
    save_file(b, str(d / "part-b.safetensors"))
    _every_reader(str(d), {**a, **b}, tmp_path)
    assert inspect_checkpoint(str(d)).files == 2


def test_a_name_in_two_files_is_refused_naming_both(tmp_path) -> None:
    d = tmp_path / "twice"
    d.mkdir()
    save_file({"w": torch.ones(2), "x": torch.ones(1)}, str(d / "one.safetensors"))
    save_file({"w": torch.zeros(2)}, str(d / "two.safetensors"))
    calls = [lambda: mmapckpt.open(str(d)), lambda: mmapckpt.load(str(d)),
             lambda: mmapckpt.load_into({"w": torch.empty(2)}, str(d)),
             lambda: mmapckpt.convert(str(d), str(tmp_path / "o.safetensors")),
             lambda: inspect_checkpoint(str(d)),
             lambda: _dcp_load({"w": torch.empty(2)}, str(d))]
    for call in calls:
        with pytest.raises(FormatError) as e:
            call()
        err = e.value
        assert "two files hold this tensor" in str(err) and "one.safetensors" in str(err) and "two.safetensors" in str(err), str(err)
    report = verify_checkpoint(str(d))
    assert not report.ok and any("one.safetensors" in str(p) and "two.safetensors" in str(p) for p in report.problems)


def test_model_safetensors_wins_over_other_files_beside_it(tmp_path) -> None:
    """With ``model.safetensors`` there, an adapter beside it is not the model's (as transformers reads it)."""
    d = tmp_path / "hf"
    d.mkdir()
    sd = _sd("m")
    save_file(sd, str(d / "model.safetensors"))
    save_file({"lora": torch.ones(2)}, str(d / "adapter_model.safetensors"))
    assert recognise(locate(str(d))).name == "hf-safetensors"
    _every_reader(str(d), sd, tmp_path)


def _layouts(tmp_path) -> dict[str, tuple[str, str]]:
    """Every layout: its path, and the record that must recognise it."""
    sd = _sd("t")
    out: dict[str, tuple[str, str]] = {}
    mmapckpt.save(sd, str(tmp_path / "mm"))
    out["mmapckpt"] = (str(tmp_path / "mm"), "mmapckpt")
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(tmp_path / "stock")), no_dist=True)
    out["dcp"] = (str(tmp_path / "stock"), "dcp")
    save_file(sd, str(tmp_path / "f.safetensors"))
    out["file"] = (str(tmp_path / "f.safetensors"), "safetensors-file")
    os.makedirs(tmp_path / "hf")
    save_file(sd, str(tmp_path / "hf" / "model.safetensors"))
    out["hf"] = (str(tmp_path / "hf"), "hf-safetensors")
    torch.save(sd, str(tmp_path / "t.pt"))
    out["torch"] = (str(tmp_path / "t.pt"), "torch-file")
    os.makedirs(tmp_path / "bin")
    torch.save(sd, str(tmp_path / "bin" / "pytorch_model.bin"))
    out["bin"] = (str(tmp_path / "bin"), "hf-bin")
    os.makedirs(tmp_path / "loose")
    save_file(sd, str(tmp_path / "loose" / "weights.safetensors"))
    out["loose"] = (str(tmp_path / "loose"), "safetensors-dir")
    return out


def test_every_layout_is_recognised_the_same_by_every_entry_point(tmp_path) -> None:
    for what, (path, record) in _layouts(tmp_path).items():
        fmt = recognise(locate_checkpoint(path))
        assert fmt.name == record, what
        assert detect_format(path) == fmt.family, what
        with mmapckpt.open(path) as f:
            assert f.kind == fmt.family, what
        assert inspect_checkpoint(path).format == fmt.family, what
        if fmt.dcp_metadata is not None:
            _dcp_load(_sd("t"), path)
        else:  # MmapReader cannot read it: the same class whichever way it is asked
            with pytest.raises(CheckpointNotFoundError, match="MmapReader .dcp.load. cannot read"):
                _dcp_load(_sd("t"), path)


def test_the_table_names_each_family_extension_once() -> None:
    assert target_family("x.safetensors") == "safetensors" and target_family("x.PT") == "torch"
    assert target_family("x.bin") == "torch" and target_family("ckpt/") == "mmapckpt"
    exts = [e for f in TABLE for e in f.extensions]
    assert len(exts) == len(set(exts))


def test_nothing_recognisable_is_not_found(tmp_path) -> None:
    (tmp_path / "config.json").write_text("{}")
    for call in (lambda: mmapckpt.open(str(tmp_path)), lambda: inspect_checkpoint(str(tmp_path)),
                 lambda: mmapckpt.convert(str(tmp_path), str(tmp_path / "o.safetensors"))):
        with pytest.raises(CheckpointNotFoundError):
            call()
