"""`verify -q` prints only problems; counts in verify and inspect output agree with their nouns."""

from __future__ import annotations

import os

import pytest
import torch

import mmapckpt
from mmapckpt.reading.shard import Shard
from mmapckpt.tools.cli import main
from mmapckpt.tools.wording import count, plural


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def one(tmp_path) -> str:
    """A checkpoint of one tensor in one shard file."""
    path = str(tmp_path / "one")
    mmapckpt.save({"w": torch.arange(16, dtype=torch.float32)}, path)
    assert [n for n in os.listdir(path) if n.endswith(".distcp")] == ["__0_0.distcp"]
    return path


def _flip_a_bit(path: str) -> None:
    shard = os.path.join(path, "__0_0.distcp")
    e = Shard(shard).header.entries[0]
    with open(shard, "r+b") as f:
        f.seek(e.offset + 1)
        b = f.read(1)
        f.seek(e.offset + 1)
        f.write(bytes([b[0] ^ 1]))


def test_quiet_verify_prints_nothing_on_a_sound_checkpoint(capsys, one) -> None:
    with open(os.path.join(one, "config.json"), "w") as f:
        f.write("{}")  # a warning, not a problem: still nothing under -q
    assert run(capsys, "verify", one, "-q") == (0, "", "")
    assert run(capsys, "verify", one, "--quiet") == (0, "", "")
    code, out, _ = run(capsys, "verify", one)
    assert code == 0 and "warning" in out and out.rstrip().endswith("; 1 unreferenced file)")


def test_quiet_verify_prints_the_problems_and_fails(capsys, one) -> None:
    _flip_a_bit(one)
    code, out, err = run(capsys, "verify", one, "-q")
    lines = out.splitlines()
    assert code == 1 and err == ""
    assert len(lines) == 2 and lines[0].startswith("PROBLEM  ") and "CRC-32" in lines[0]
    assert lines[1] == f"{one}: NOT sound: 1 problem"


def test_singular_counts_in_verify_and_inspect(capsys, one) -> None:
    code, out, _ = run(capsys, "verify", one)
    assert code == 0
    assert "1 entry, 1 storage record in 1 shard file\n" in out
    assert "(format 1." in out and ", 1 entry in bounds" in out and "; 1 checksum matches (" in out
    for bad in ("1 entries", "1 shard files", "1 checksums", "1 storage records"):
        assert bad not in out
    code, out, _ = run(capsys, "inspect", one)
    assert code == 0 and ", 1 file\n" in out.splitlines(keepends=True)[0]
    assert "total: 1 entry (1 tensor, 0 non-tensor)," in out


def test_plural_counts_in_verify_and_inspect(capsys, tmp_path) -> None:
    path = str(tmp_path / "two")
    mmapckpt.save({"a": torch.ones(4), "b": torch.zeros(2)}, path)
    code, out, _ = run(capsys, "verify", path)
    assert code == 0 and "2 entries, 2 storage records in 1 shard file" in out and "2 checksums match (" in out
    code, out, _ = run(capsys, "inspect", path)
    assert code == 0 and "total: 2 entries (2 tensors, 0 non-tensor)," in out


def test_count_and_plural() -> None:
    assert [count(n, "shard file") for n in (0, 1, 2)] == ["0 shard files", "1 shard file", "2 shard files"]
    assert [count(n, "entry") for n in (1, 3)] == ["1 entry", "3 entries"]
    assert plural("key") == "keys" and plural("pass") == "passes" and plural("patch") == "patches"
    assert count(2, "index", "indices") == "2 indices"
