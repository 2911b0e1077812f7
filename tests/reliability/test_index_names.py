"""A Hugging Face index whose weight_map gives a file name no file can have (a NUL byte, a lone surrogate, an empty
name, a directory) is a FormatError naming the index and the entry, through every entry point: open, load,
load_into, dcp.load with MmapReader (unwrapped with checkpoint_error), convert, inspect and verify (the API and
the CLI), for safetensors and torch.save (`.bin`) indexes alike (reading/locate.py: one check where the index's
names become file names)."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import safetensors.torch
import torch
import torch.distributed.checkpoint as dcp

import mmapckpt
from mmapckpt import FormatError, MmapReader
from mmapckpt.tools.cli import main
from mmapckpt.tools.describe import inspect_checkpoint
from mmapckpt.tools.verify import verify_checkpoint
from unmapped import medium, url  # noqa: F401  (medium: the unmapped:// fixture)

_FILES = {"safetensors": ("model.safetensors.index.json", "model-{:05d}-of-00002.safetensors"),
          "torch": ("pytorch_model.bin.index.json", "pytorch_model-{:05d}-of-00002.bin")}

#: what the index gives as tensor "b"'s file, and the words the refusal uses
BAD_NAMES = [("{shard}\x00.evil", "NUL byte"), ("\x00", "NUL byte"), ("{shard}\ud800", "lone surrogate"),
             ("", "is empty"), ("sub/", "names a directory")]


def _hf_dir(root, kind: str, bad: str) -> tuple[str, str, str]:
    """A two-shard Hugging Face directory of ``kind`` whose index gives tensor "b"'s file as ``bad``
    (``{shard}``: the real second shard's name). Returns (directory, index path, the name given)."""
    d = root / kind
    d.mkdir()
    index, pattern = _FILES[kind]
    shards = [pattern.format(1), pattern.format(2)]
    parts = [{"a": torch.arange(4.0)}, {"b": torch.ones(3)}]
    for name, part in zip(shards, parts):
        if kind == "safetensors":
            safetensors.torch.save_file(part, str(d / name))
        else:
            torch.save(part, str(d / name))
    given = bad.format(shard=shards[1])
    # json.dumps writes a lone surrogate as the escape \ud800, which json.loads reads back as one
    (d / index).write_text(json.dumps({"metadata": {}, "weight_map": {"a": shards[0], "b": given}}))
    return str(d), str(d / index), given


def _check(e: BaseException, index: str, why: str) -> None:
    assert isinstance(e, FormatError), repr(e)
    assert e.path == index and e.entry == "b" and why in str(e), str(e)


@pytest.mark.parametrize("kind", list(_FILES))
@pytest.mark.parametrize("bad,why", BAD_NAMES)
def test_an_impossible_file_name_in_the_index_is_a_format_error_everywhere(tmp_path, capsys, kind, bad, why):
    d, index, given = _hf_dir(tmp_path, kind, bad)
    calls = [lambda: mmapckpt.open(d), lambda: mmapckpt.load(d),
             lambda: mmapckpt.load_into({"a": torch.zeros(4)}, d),
             lambda: mmapckpt.convert(d, str(tmp_path / "out"), to="mmapckpt"),
             lambda: inspect_checkpoint(d)]
    for call in calls:
        with pytest.raises(FormatError) as ei:
            call()
        _check(ei.value, index, why)
    assert not os.path.exists(tmp_path / "out")
    report = verify_checkpoint(d)
    assert not report.ok and report.problems[0].path == index and report.problems[0].entry == "b"
    assert why in report.problems[0].message
    if kind == "safetensors":  # MmapReader reads Hugging Face safetensors directories (not .bin ones)
        reader = MmapReader(d)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # DCP's "torch.distributed is disabled"
            with pytest.raises(BaseException) as ei:
                dcp.load({"a": torch.zeros(4)}, storage_reader=reader, no_dist=True)
        _check(mmapckpt.checkpoint_error(ei.value, reader), index, why)
    capsys.readouterr()
    for command in ("inspect", "verify"):
        assert main([command, d]) == 1
        out = capsys.readouterr()
        assert index in out.out + out.err and why in out.out + out.err, (command, out)
        assert "Traceback" not in out.err


@pytest.mark.parametrize("kind", list(_FILES))
def test_the_same_on_a_medium_without_mappings(tmp_path, medium, kind):  # noqa: F811
    """At a URL (an object store's prefix) the index is refused the same way, before any name reaches the store."""
    d, _, _ = _hf_dir(tmp_path, kind, "{shard}\x00")
    u = url(d)
    for call in (lambda: mmapckpt.load(u), lambda: mmapckpt.convert(u, str(tmp_path / "out"), to="mmapckpt")):
        with pytest.raises(FormatError) as ei:
            call()
        assert ei.value.entry == "b" and ei.value.path.endswith(_FILES[kind][0]) and "NUL" in str(ei.value)


def test_a_name_with_odd_but_possible_characters_still_loads(tmp_path):
    """The check refuses only names no file can have: spaces, unicode and a subdirectory are fine."""
    d = tmp_path / "odd"
    (d / "sub dir").mkdir(parents=True)
    names = ["sub dir/modèle-1.safetensors", "ß b.safetensors"]
    safetensors.torch.save_file({"a": torch.arange(4.0)}, str(d / names[0]))
    safetensors.torch.save_file({"b": torch.ones(3)}, str(d / names[1]))
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": names[0], "b": names[1]}}))
    got = mmapckpt.load(str(d))
    assert torch.equal(got["a"], torch.arange(4.0)) and torch.equal(got["b"], torch.ones(3))
