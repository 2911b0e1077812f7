"""verify_checkpoint: every defect of an mmapckpt checkpoint is found and reported, all at once."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint import FileSystemWriter

from mmapckpt import CheckpointNotFoundError, MmapWriter, verify_checkpoint
from mmapckpt.reading.shard import Shard


def _state() -> dict:
    g = torch.Generator().manual_seed(1)
    return {"a": torch.randn(300, generator=g), "b": torch.randint(0, 100, (7, 3), generator=g),
            "c": torch.randn(50, generator=g).to(torch.bfloat16), "d": torch.ones(5000, dtype=torch.uint8),
            "step": 12, "name": "run-7"}


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> str:
    """A sound checkpoint in two shard files (thread_count=2)."""
    path = str(tmp_path_factory.mktemp("verify") / "ck")
    dcp.save(_state(), storage_writer=MmapWriter(path, thread_count=2), no_dist=True)
    assert len([n for n in os.listdir(path) if n.endswith(".distcp")]) == 2
    return path


@pytest.fixture
def ck(pristine, tmp_path) -> str:
    path = str(tmp_path / "ck")
    shutil.copytree(pristine, path)
    return path


def _shards(path: str) -> list[str]:
    return sorted(os.path.join(path, n) for n in os.listdir(path) if n.endswith(".distcp"))


def _entries(path: str) -> list[tuple[str, object]]:
    return [(f, e) for f in _shards(path) for e in Shard(f).header.entries]


def _flip(path: str, offset: int, bit: int = 0) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([b ^ (1 << bit)]))


def test_sound_checkpoint(pristine) -> None:
    r = verify_checkpoint(pristine)
    assert r.ok and r.problems == []
    assert r.bytes_checked == sum(e.length for _, e in _entries(pristine))
    text = "\n".join(r.checked)
    assert "committed" in text and "checksums match" in text
    assert sum("__0_" in line for line in r.checked) == 2  # one line per shard file


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(which=st.integers(0, 10**6), where=st.floats(0, 1, exclude_max=True), bit=st.integers(0, 7))
def test_any_flipped_data_byte_is_reported(pristine, tmp_path_factory, which, where, bit) -> None:
    path = str(tmp_path_factory.mktemp("flip") / "ck")
    shutil.copytree(pristine, path)
    entries = [(f, e) for f, e in _entries(path) if e.length]
    f, e = entries[which % len(entries)]
    _flip(f, e.offset + int(where * e.length), bit)
    r = verify_checkpoint(path)
    assert not r.ok
    assert [(p.path, p.entry) for p in r.problems] == [(f, e.label)]
    assert "CRC-32" in r.problems[0].message


def test_every_problem_is_collected(ck) -> None:
    """Damage in both shards and in two entries of one: all three are reported in one run."""
    (f0, f1) = _shards(ck)
    e0 = [e for e in Shard(f0).header.entries if e.length]
    e1 = [e for e in Shard(f1).header.entries if e.length]
    _flip(f0, e0[0].offset)
    _flip(f0, e0[-1].offset + e0[-1].length - 1)
    _flip(f1, e1[0].offset + 1)
    r = verify_checkpoint(ck)
    assert sorted((p.path, p.entry) for p in r.problems) == sorted(
        [(f0, e0[0].label), (f0, e0[-1].label), (f1, e1[0].label)])


def test_truncated_shard(ck) -> None:
    f0, f1 = _shards(ck)
    last = max(Shard(f0).header.entries, key=lambda e: e.offset + e.length)
    os.truncate(f0, last.offset + last.length - 1)  # one byte of data short
    _flip(f1, next(e for e in Shard(f1).header.entries if e.length).offset)
    r = verify_checkpoint(ck)
    assert len(r.problems) == 2
    trunc = next(p for p in r.problems if p.path == f0)
    assert "past the end" in trunc.message and trunc.entry == last.label
    assert any(p.path == f1 and "CRC-32" in p.message for p in r.problems)  # the other shard is still checked


def test_missing_shard(ck) -> None:
    f0, _ = _shards(ck)
    lost = {e.label for e in Shard(f0).header.entries}
    os.unlink(f0)
    r = verify_checkpoint(ck)
    assert len(r.problems) == 1 and r.problems[0].path == f0
    assert "missing" in r.problems[0].message and f"{len(lost)} entries lost" in r.problems[0].message


def test_shard_of_another_checkpoint_mixed_in(ck, tmp_path) -> None:
    """Same names, another save's bytes: the metadata and the header disagree."""
    other = str(tmp_path / "other")
    sd = {k: (torch.zeros(v.numel() + 1, dtype=v.dtype) if isinstance(v, torch.Tensor) else v)
          for k, v in _state().items()}
    dcp.save(sd, storage_writer=MmapWriter(other, thread_count=2), no_dist=True)
    for f in _shards(other):
        shutil.copy(f, os.path.join(ck, os.path.basename(f)))
    r = verify_checkpoint(ck)
    assert not r.ok
    msgs = " | ".join(p.message for p in r.problems)
    assert "written by save" in msgs or "header says" in msgs


def test_metadata_problems(ck, tmp_path) -> None:
    meta = os.path.join(ck, ".metadata")
    _flip(meta, os.path.getsize(meta) - 5)
    r = verify_checkpoint(ck)
    assert len(r.problems) == 1 and "checksum" in r.problems[0].message
    os.unlink(meta)
    r = verify_checkpoint(ck)
    assert len(r.problems) == 1 and "incomplete" in r.problems[0].message


def test_stock_dcp_is_verified_item_by_item(tmp_path) -> None:
    """A stock DCP checkpoint: its files present and reaching their records, every tensor item loaded as a load
    reads it; a damaged item is a problem naming its file and entry; an unreferenced file is a warning."""
    d = tmp_path / "s"
    dcp.save({"a": torch.ones(3), "b": torch.arange(1000), "step": 7}, storage_writer=FileSystemWriter(str(d)),
             no_dist=True)
    r = verify_checkpoint(d)
    assert r.ok, r.problems
    assert any("loads as a load reads it" in c for c in r.checked) and any("no checksums" in n for n in r.notes)
    (shard,) = [n for n in os.listdir(d) if n.endswith(".distcp")]
    (d / "notes.txt").write_text("x")
    with open(d / shard, "r+b") as f:  # the zip framing of every item: each torch.save item starts "PK"
        data = bytearray(f.read())
        for at in [i for i in range(len(data) - 1) if data[i:i + 4] == b"PK\x03\x04"]:
            data[at:at + 4] = b"XXXX"
        f.seek(0)
        f.write(data)
    r = verify_checkpoint(d)
    assert not r.ok and {p.entry.split("@")[0] for p in r.problems} == {"a", "b"}
    assert all(p.path == str(d / shard) and p.error == "FormatError" for p in r.problems)
    assert [os.path.basename(w.path) for w in r.warnings] == ["notes.txt"]


def test_missing_path_raises(tmp_path) -> None:
    with pytest.raises(CheckpointNotFoundError):
        verify_checkpoint(tmp_path / "nothing")


def test_unreferenced_files_are_warnings_with_sizes_not_problems(ck) -> None:
    assert verify_checkpoint(ck).warnings == []
    files = {"__9_0.distcp": 0, ".__0_0.distcp.tmp-1a2b3c": 123, "config.json": 17, "notes.txt": 4096}
    for name, size in files.items():
        with open(os.path.join(ck, name), "wb") as f:
            f.write(b"x" * size)
    os.makedirs(os.path.join(ck, "tokenizer"))  # a directory is not a file the checkpoint could reference
    open(os.path.join(ck, "__3.metadata"), "wb").close()  # a per-rank commit file: metadata, not unreferenced
    r = verify_checkpoint(ck)
    assert r.ok and r.problems == []
    got = {os.path.basename(w.path): w.size for w in r.warnings}
    assert got == files
    assert all(w.path == os.path.join(ck, os.path.basename(w.path)) for w in r.warnings)
    why = {os.path.basename(w.path): w.message for w in r.warnings}
    assert "left over" in why["__9_0.distcp"] and "temporary" in why[".__0_0.distcp.tmp-1a2b3c"]
    assert "not part of the checkpoint" in why["config.json"]
    doc = r.to_json()
    assert doc["ok"] is True
    assert {os.path.basename(w["path"]): w["bytes"] for w in doc["warnings"]} == files
