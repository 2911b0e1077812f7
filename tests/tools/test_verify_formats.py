"""``mmapckpt verify``/``inspect``/``convert`` on safetensors files, Hugging Face directories and torch.save files."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import helpers
import pytest
import safetensors.torch
import torch

import mmapckpt
from mmapckpt import verify_checkpoint
from mmapckpt.tools.cli import main


def _sd() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {"embed.weight": torch.randn(16, 8, generator=g), "norm.weight": torch.ones(8, dtype=torch.bfloat16),
            "ids": torch.arange(7)}


@pytest.fixture
def hf_single(tmp_path) -> str:
    d = tmp_path / "hf"
    d.mkdir()
    safetensors.torch.save_file(_sd(), str(d / "model.safetensors"), metadata={"format": "pt"})
    (d / "config.json").write_text("{}")
    (d / "tokenizer.json").write_text("{}")
    return str(d)


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([b ^ 1]))


def test_verify_safetensors_says_what_it_checks(hf_single, capsys) -> None:
    for path in (hf_single, os.path.join(hf_single, "model.safetensors")):
        r = verify_checkpoint(path)
        assert r.ok, r.problems
        assert any("header valid (3 tensors" in c for c in r.checked)
        assert any("no checksums" in n for n in r.notes)
        assert main(["verify", path]) == 0
        out = capsys.readouterr().out
        assert "no checksums" in out and "no checkpoint here" not in out


def test_verify_safetensors_finds_a_damaged_header(hf_single, capsys) -> None:
    f = os.path.join(hf_single, "model.safetensors")
    with open(f, "r+b") as fh:
        fh.truncate(os.path.getsize(f) - 4)
    r = verify_checkpoint(hf_single)
    assert not r.ok and r.problems[0].path == f and "past the end" in r.problems[0].message
    assert main(["verify", hf_single]) == 1
    assert "PROBLEM" in capsys.readouterr().out


def test_verify_sharded_index(tmp_path) -> None:
    d = tmp_path / "sh"
    d.mkdir()
    safetensors.torch.save_file({"a": torch.ones(2)}, str(d / "a.safetensors"))
    safetensors.torch.save_file({"b": torch.ones(3), "stray": torch.ones(1)}, str(d / "b.safetensors"))
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "a.safetensors",
                                                                               "b": "b.safetensors"}}))
    r = verify_checkpoint(d)
    assert r.ok, r.problems
    assert any("2 tensors in 2 files" in c for c in r.checked)
    assert any("'stray'" in n and "weight_map" in n for n in r.notes)
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "a.safetensors",
                                                                               "c": "c.safetensors"}}))
    r = verify_checkpoint(d)
    assert not r.ok and "missing" in r.problems[0].message and r.problems[0].entry == "c"


def test_verify_torch_file_checks_zip_crcs(tmp_path, capsys) -> None:
    path = str(tmp_path / "m.pt")
    sd = _sd()
    torch.save(sd, path)
    r = verify_checkpoint(path)
    assert r.ok, r.problems
    assert any("weights_only=True" in c for c in r.checked) and any("CRC-32s match" in c for c in r.checked)
    assert r.bytes_checked >= sum(t.numel() * t.element_size() for t in sd.values())
    data = Path(path).read_bytes()
    _flip(path, data.find(sd["embed.weight"].numpy().tobytes()[:16]) + 5)
    assert torch.load(path, weights_only=True, mmap=True)["embed.weight"].shape == (16, 8)  # torch.load does not see it
    r = verify_checkpoint(path)
    assert not r.ok and "data/" in (r.problems[0].entry or "") and "CRC" in r.problems[0].message
    assert main(["verify", path]) == 1
    capsys.readouterr()


def test_verify_unloadable_torch_file(tmp_path) -> None:
    path = tmp_path / "t.pt"
    torch.save(torch.ones(2), path)  # a tensor, not a state dict
    r = verify_checkpoint(path)
    assert not r.ok and "not a state dict" in r.problems[0].message


def test_verify_still_refuses_what_is_no_checkpoint(tmp_path) -> None:
    (tmp_path / "notes.txt").write_text("x")
    r = verify_checkpoint(tmp_path / "notes.txt")
    assert not r.ok
    bad = tmp_path / "x.safetensors"
    bad.write_bytes(struct.pack("<Q", 2) + b"[]")
    r = verify_checkpoint(bad)
    assert not r.ok and "not a JSON object" in r.problems[0].message


def test_inspect_and_convert_take_a_single_model_safetensors_directory(hf_single, tmp_path, capsys) -> None:
    info = mmapckpt.inspect_checkpoint(hf_single)
    assert info.format == "safetensors" and info.version == "model.safetensors in a directory" and info.files == 1
    assert sorted(e.name for e in info.entries) == sorted(_sd())
    assert main(["inspect", hf_single]) == 0
    assert "model.safetensors in a directory" in capsys.readouterr().out
    out = str(tmp_path / "mm")
    mmapckpt.convert(hf_single, out, to="mmapckpt")
    helpers.assert_tree_equal(mmapckpt.load(out), _sd())
    assert verify_checkpoint(out).ok
    assert main(["convert", hf_single, str(tmp_path / "back.pt"), "--to", "torch", "-q"]) == 0
    helpers.assert_tree_equal(torch.load(tmp_path / "back.pt", weights_only=True), _sd())
