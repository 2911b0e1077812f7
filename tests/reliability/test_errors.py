"""Bad checkpoints through MmapReader and dcp.load: the right error, naming file and entry, and no crash.

Errors in ``read_data`` reach the caller as ``CheckpointException.failures[0]``.
Errors in ``read_metadata`` do not keep their type through dcp.load in torch 2.13:
its loader catches them, tries the rank-local metadata, and raises an
AssertionError quoting both messages. Those cases check the type on
``MmapReader.read_metadata()`` and the message through ``dcp.load``.

The corruption cases run in the pytest process itself, so a SIGBUS or segfault
would kill the run; one case also runs in a child process and checks its exit.
"""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import textwrap
import zlib
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

import mmapckpt
from helpers import as_metadata_v1, assert_tree_equal, dcp_failure, dcp_load, dcp_save
from strategies import fresh_like

SHARD = "__0_0.distcp"


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(5)
    return {"w": torch.randn(40, 50, generator=g), "b": torch.randn(6, generator=g).to(torch.bfloat16),
            "step": 3}


@pytest.fixture
def ckpt(tmp_path) -> Path:
    path = tmp_path / "ckpt"
    dcp_save(_state(), mmapckpt.MmapWriter(path, sync_files=False))
    return path


def load_failure(path: Path, targets: Any = None, **reader_kw: Any) -> BaseException:
    """Run dcp.load with MmapReader, expect it to fail, return the original exception."""
    targets = fresh_like(_state()) if targets is None else targets
    with pytest.raises(dcp.api.CheckpointException) as ei:
        dcp_load(targets, mmapckpt.MmapReader(path, **reader_kw))
    return dcp_failure(ei.value)


def assert_names(err: BaseException, file: str | Path, entry: str | None = None) -> None:
    msg = str(err)
    assert os.fspath(file) in msg, msg
    if entry is not None:
        assert repr(entry) in msg, msg


def still_works(tmp_path: Path) -> None:
    """The process survived the failure and loads a good checkpoint as before."""
    sd = _state()
    dcp_save(sd, mmapckpt.MmapWriter(tmp_path / "good", sync_files=False))
    assert_tree_equal(sd, dcp_load(fresh_like(sd), mmapckpt.MmapReader(tmp_path / "good")))


def read_header(path: Path) -> tuple[dict[str, Any], int]:
    """(header JSON, first data offset) of a shard, parsed by hand."""
    raw = path.read_bytes()
    hlen = struct.unpack_from("<Q", raw, 16)[0]
    doc = json.loads(raw[32:32 + hlen])
    return doc, min(e["offset"] for e in doc["entries"])


def rewrite_header(path: Path, mutate: Callable[[dict[str, Any]], None], **preamble: int) -> None:
    """Change a shard's header JSON (and optionally preamble fields), keeping it self-consistent
    (length and CRC-32 updated) so that only the intended defect remains."""
    doc, data_start = read_header(path)
    mutate(doc)
    body = json.dumps(doc, separators=(",", ":")).encode()
    assert 32 + len(body) <= data_start, "the edited header must still fit before the data"
    raw = bytearray(path.read_bytes())
    raw[8:10] = preamble.get("major", 1).to_bytes(2, "little")
    raw[16:24] = len(body).to_bytes(8, "little")
    raw[24:28] = zlib.crc32(body).to_bytes(4, "little")
    raw[32:data_start] = body + b"\0" * (data_start - 32 - len(body))
    path.write_bytes(bytes(raw))


def rewrite_metadata(path: Path, mutate: Callable[[dict[str, Any]], None]) -> None:
    """Change an mmapckpt .metadata file's JSON body in its version-1 form (one object per item and
    record), keeping its length and CRC-32 right."""
    as_metadata_v1(path.parent)
    raw = path.read_bytes()
    assert raw[:8] == b"\xffMMAPMD\n"
    doc = json.loads(raw[24:])
    mutate(doc)
    body = json.dumps(doc, separators=(",", ":")).encode()
    path.write_bytes(raw[:12] + struct.pack("<IQ", zlib.crc32(body), len(body)) + body)


def entry_named(doc: dict[str, Any], fqn: str) -> dict[str, Any]:
    [e] = [e for e in doc["entries"] if e["fqn"] == fqn]
    return e


# --------------------------------------------------------------------------- missing / incomplete
def test_missing_checkpoint_directory(tmp_path) -> None:
    path = tmp_path / "nope"
    with pytest.raises(mmapckpt.CheckpointNotFoundError) as ei:
        mmapckpt.MmapReader(path).read_metadata()
    assert isinstance(ei.value, FileNotFoundError)
    assert_names(ei.value, path)
    with pytest.raises(dcp.api.CheckpointException) as ei2:
        dcp_load(fresh_like(_state()), mmapckpt.MmapReader(path))
    assert "no checkpoint" in str(dcp_failure(ei2.value)) and str(path) in str(dcp_failure(ei2.value))
    still_works(tmp_path)


def test_empty_directory_is_not_a_checkpoint(tmp_path) -> None:
    with pytest.raises(mmapckpt.CheckpointNotFoundError) as ei:
        mmapckpt.MmapReader(tmp_path).read_metadata()
    assert_names(ei.value, tmp_path)
    assert not isinstance(ei.value, mmapckpt.IncompleteCheckpointError)


def test_shards_without_metadata_are_incomplete(ckpt: Path) -> None:
    (ckpt / ".metadata").unlink()
    with pytest.raises(mmapckpt.IncompleteCheckpointError) as ei:
        mmapckpt.MmapReader(ckpt).read_metadata()
    assert isinstance(ei.value, FileNotFoundError)
    assert_names(ei.value, ckpt)
    assert "incomplete" in str(ei.value)
    with pytest.raises(dcp.api.CheckpointException) as ei2:
        dcp_load(fresh_like(_state()), mmapckpt.MmapReader(ckpt))
    assert "incomplete" in str(dcp_failure(ei2.value))


def test_only_temp_shards_are_incomplete(tmp_path) -> None:
    """A save killed before any rename leaves only temporary shard files."""
    (tmp_path / f".{SHARD}.tmp-0123456789ab").write_bytes(b"MMAPCKPT")
    with pytest.raises(mmapckpt.IncompleteCheckpointError):
        mmapckpt.MmapReader(tmp_path).read_metadata()


def test_missing_shard_file(ckpt: Path, tmp_path) -> None:
    (ckpt / SHARD).unlink()
    err = load_failure(ckpt)
    assert type(err) is mmapckpt.IncompleteCheckpointError, f"{type(err).__name__}: {err}"
    assert isinstance(err, FileNotFoundError)
    assert_names(err, ckpt / SHARD)
    assert "missing" in str(err) and err.entry is not None
    still_works(tmp_path)


# --------------------------------------------------------------------------- preamble defects
def test_bad_magic(ckpt: Path, tmp_path) -> None:
    with open(ckpt / SHARD, "r+b") as f:
        f.write(b"PK\x03\x04")  # looks like a stock (zip) shard now: still refused, never torch.load-ed
    err = load_failure(ckpt)
    assert type(err) is mmapckpt.BadMagicError, f"{type(err).__name__}: {err}"
    assert isinstance(err, ValueError)
    assert_names(err, ckpt / SHARD)
    still_works(tmp_path)


def test_bad_magic_never_reaches_torch_load(ckpt: Path, monkeypatch) -> None:
    calls = []
    monkeypatch.setattr(torch, "load", lambda *a, **k: calls.append(a) or torch.zeros(0))
    with open(ckpt / SHARD, "r+b") as f:
        f.write(b"XXXXXXXX")
    assert isinstance(load_failure(ckpt), mmapckpt.BadMagicError)
    assert calls == []


@pytest.mark.parametrize("major", [0, 2, 65535])
def test_unsupported_shard_version(ckpt: Path, major: int) -> None:
    rewrite_header(ckpt / SHARD, lambda d: None, major=major)
    err = load_failure(ckpt)
    assert type(err) is mmapckpt.UnsupportedVersionError
    assert_names(err, ckpt / SHARD)
    assert f"version {major}" in str(err)


def test_unsupported_metadata_version(ckpt: Path) -> None:
    raw = bytearray((ckpt / ".metadata").read_bytes())
    raw[8:10] = (3).to_bytes(2, "little")
    (ckpt / ".metadata").write_bytes(bytes(raw))
    with pytest.raises(mmapckpt.UnsupportedVersionError) as ei:
        mmapckpt.MmapReader(ckpt).read_metadata()
    assert_names(ei.value, ckpt / ".metadata")
    with pytest.raises(dcp.api.CheckpointException) as ei2:
        dcp_load(fresh_like(_state()), mmapckpt.MmapReader(ckpt))
    assert "metadata version 3" in str(dcp_failure(ei2.value))


def test_other_byte_order(ckpt: Path) -> None:
    raw = bytearray((ckpt / SHARD).read_bytes())
    raw[12] = 2 if sys.byteorder == "little" else 1
    (ckpt / SHARD).write_bytes(bytes(raw))
    err = load_failure(ckpt)
    assert type(err) is mmapckpt.ByteOrderError
    assert_names(err, ckpt / SHARD)


# --------------------------------------------------------------------------- truncation
def _truncation_points(path: Path) -> dict[str, int]:
    doc, data_start = read_header(path)
    w = entry_named(doc, "w")
    return {"empty": 0, "in-preamble": 20, "in-header": 40, "before-data": data_start,
            "in-w": w["offset"] + w["length"] // 2}


@pytest.mark.parametrize("where", ["empty", "in-preamble", "in-header", "before-data", "in-w"])
def test_truncated_shard(ckpt: Path, tmp_path, where: str) -> None:
    size = _truncation_points(ckpt / SHARD)[where]
    os.truncate(ckpt / SHARD, size)
    err = load_failure(ckpt)
    assert type(err) is mmapckpt.TruncatedFileError, f"{type(err).__name__}: {err}"
    assert isinstance(err, ValueError)
    assert_names(err, ckpt / SHARD)
    assert f"{size}" in str(err)
    if where in ("before-data", "in-w"):
        assert err.entry is not None and err.entry.split("@")[0] in ("w", "b", "step")
    still_works(tmp_path)


def test_truncated_inside_the_tail_padding_still_loads(ckpt: Path) -> None:
    """Only the zero padding after the last entry is lost: every entry is intact, so the load is right."""
    doc, _ = read_header(ckpt / SHARD)
    end = max(e["offset"] + e["length"] for e in doc["entries"])
    os.truncate(ckpt / SHARD, end)
    assert_tree_equal(_state(), dcp_load(fresh_like(_state(), 0xA5), mmapckpt.MmapReader(ckpt)))


def test_truncated_stock_shard_through_mmap_reader(tmp_path) -> None:
    path = tmp_path / "stock"
    dcp_save(_state(), FileSystemWriter(path))
    size = (path / SHARD).stat().st_size
    os.truncate(path / SHARD, size // 2)
    err = load_failure(path)
    assert isinstance(err, mmapckpt.CheckpointError) and isinstance(err, ValueError)
    assert_names(err, path / SHARD)
    assert err.entry is not None


def test_truncated_shard_does_not_kill_a_child_process(tmp_path) -> None:
    """In a fresh interpreter: a shard truncated mid-tensor ends in an exception, not a signal."""
    script = textwrap.dedent(f"""
        import os, sys, warnings
        warnings.simplefilter("ignore")
        sys.path.insert(0, {os.path.dirname(os.path.dirname(os.path.abspath(__file__)))!r})
        import torch, mmapckpt
        from helpers import dcp_save, dcp_load, dcp_failure
        path = {str(tmp_path / "c")!r}
        dcp_save({{"w": torch.arange(100_000, dtype=torch.float32)}}, mmapckpt.MmapWriter(path, sync_files=False))
        os.truncate(os.path.join(path, "{SHARD}"), 4096 + 1000)
        try:
            dcp_load({{"w": torch.zeros(100_000)}}, mmapckpt.MmapReader(path))
        except BaseException as e:
            print("ERROR", type(dcp_failure(e)).__name__)
            sys.exit(0)
        print("LOADED")
        sys.exit(3)
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert r.returncode != -signal.SIGBUS and r.returncode != -signal.SIGSEGV, r.stderr[-2000:]
    assert r.returncode == 0, r.stdout + r.stderr[-2000:]
    assert "ERROR TruncatedFileError" in r.stdout


# --------------------------------------------------------------------------- header defects
def test_entry_out_of_bounds(ckpt: Path, tmp_path) -> None:
    size = (ckpt / SHARD).stat().st_size
    rewrite_header(ckpt / SHARD, lambda d: entry_named(d, "w").update(offset=size))
    err = load_failure(ckpt)
    assert type(err) is mmapckpt.TruncatedFileError  # the data would run past the end of the file
    assert_names(err, ckpt / SHARD, "w@[0, 0]")
    still_works(tmp_path)


def test_entry_overlapping_another(ckpt: Path) -> None:
    def overlap(d: dict[str, Any]) -> None:
        entry_named(d, "b").update(offset=entry_named(d, "w")["offset"] + 64)
    rewrite_header(ckpt / SHARD, overlap)
    err = load_failure(ckpt)
    assert type(err) is mmapckpt.EntryBoundsError
    assert_names(err, ckpt / SHARD)
    assert "overlaps" in str(err)


def test_misaligned_entry(ckpt: Path) -> None:
    rewrite_header(ckpt / SHARD, lambda d: entry_named(d, "w").update(offset=entry_named(d, "w")["offset"] + 4))
    err = load_failure(ckpt)
    assert type(err) is mmapckpt.EntryBoundsError
    assert_names(err, ckpt / SHARD, "w@[0, 0]")


def test_unknown_dtype_in_shard(ckpt: Path) -> None:
    rewrite_header(ckpt / SHARD, lambda d: entry_named(d, "b").update(dtype="bfloat17"))
    err = load_failure(ckpt)
    assert type(err) is mmapckpt.UnknownDtypeError
    assert_names(err, ckpt / SHARD, "b@[0]")
    assert "bfloat17" in str(err)


def test_unknown_dtype_in_metadata(ckpt: Path) -> None:
    rewrite_metadata(ckpt / ".metadata", lambda d: d["state_dict_metadata"]["w"].update(dtype="float3"))
    with pytest.raises(mmapckpt.UnknownDtypeError) as ei:
        mmapckpt.MmapReader(ckpt).read_metadata()
    assert_names(ei.value, ckpt / ".metadata", "w")


def test_dtype_disagreeing_with_metadata(ckpt: Path) -> None:
    """Same byte length, other dtype: refused rather than reinterpreted."""
    rewrite_header(ckpt / SHARD, lambda d: entry_named(d, "b").update(dtype="float16"))
    err = load_failure(ckpt)
    assert isinstance(err, mmapckpt.FormatError)
    assert_names(err, ckpt / SHARD, "b@[0]")


def test_damaged_header_bytes(ckpt: Path) -> None:
    raw = bytearray((ckpt / SHARD).read_bytes())
    raw[40] ^= 0x01  # a flipped bit inside the JSON
    (ckpt / SHARD).write_bytes(bytes(raw))
    err = load_failure(ckpt)
    assert type(err) is mmapckpt.FormatError and "checksum" in str(err)
    assert_names(err, ckpt / SHARD)


# --------------------------------------------------------------------------- size mismatch
def test_stored_shape_disagrees_with_target(ckpt: Path, tmp_path) -> None:
    """The shard says [50, 40] where the metadata and target say [40, 50] (same byte count)."""
    rewrite_header(ckpt / SHARD, lambda d: entry_named(d, "w").update(shape=[50, 40]))
    err = load_failure(ckpt)
    assert type(err) is mmapckpt.SizeMismatchError, f"{type(err).__name__}: {err}"
    assert isinstance(err, ValueError)
    assert_names(err, ckpt / SHARD, "w@[0, 0]")
    still_works(tmp_path)


def test_target_of_another_shape_is_refused(ckpt: Path) -> None:
    """A target that disagrees with the metadata is refused by DCP's planner before any read."""
    targets = fresh_like(_state())
    targets["w"] = torch.zeros(50, 40)
    with pytest.raises(dcp.api.CheckpointException) as ei:
        dcp_load(targets, mmapckpt.MmapReader(ckpt))
    err = dcp_failure(ei.value)
    assert isinstance(err, ValueError) and "w" in str(err)
    assert targets["w"].count_nonzero() == 0


def test_metadata_record_disagrees_with_header(ckpt: Path) -> None:
    def shift(d: dict[str, Any]) -> None:
        for r in d["storage_data"]:
            if r["fqn"] == "b":
                r["file_offset"] = 64  # inside the file and no other record's bytes, but not b's (the header's)
    rewrite_metadata(ckpt / ".metadata", shift)
    err = load_failure(ckpt)
    assert isinstance(err, mmapckpt.FormatError) and "shard header says" in str(err)
    assert_names(err, ckpt / SHARD, "b@[0]")


def test_metadata_record_overlapping_another_is_refused_with_the_metadata(ckpt: Path) -> None:
    def shift(d: dict[str, Any]) -> None:
        recs = sorted((r for r in d["storage_data"] if r["relative_path"] == SHARD), key=lambda r: r["file_offset"])
        recs[1]["file_offset"] = recs[0]["file_offset"] + 8  # starts inside the record before it
    rewrite_metadata(ckpt / ".metadata", shift)
    with pytest.raises(mmapckpt.EntryBoundsError, match="overlaps that of") as e:
        mmapckpt.load(ckpt, allow_unpickle=True)
    assert e.value.path == os.fspath(ckpt / ".metadata") and e.value.entry


# --------------------------------------------------------------------------- corrupted data
def test_corrupted_data_detected_with_verify(ckpt: Path) -> None:
    doc, _ = read_header(ckpt / SHARD)
    off = entry_named(doc, "w")["offset"] + 100
    raw = bytearray((ckpt / SHARD).read_bytes())
    raw[off] ^= 0x40
    (ckpt / SHARD).write_bytes(bytes(raw))
    err = load_failure(ckpt, verify=True)
    assert type(err) is mmapckpt.ChecksumError
    assert_names(err, ckpt / SHARD, "w@[0, 0]")


# --------------------------------------------------------------------------- paths
@pytest.mark.parametrize("rel", ["../outside.distcp", "/etc/passwd", "a/../../x.distcp", "", "sub//x"])
def test_path_traversal_in_metadata(ckpt: Path, rel: str) -> None:
    def retarget(d: dict[str, Any]) -> None:
        for r in d["storage_data"]:
            r["relative_path"] = rel
    rewrite_metadata(ckpt / ".metadata", retarget)
    with pytest.raises(mmapckpt.UnsafePathError) as ei:
        mmapckpt.MmapReader(ckpt).read_metadata()
    assert_names(ei.value, ckpt / ".metadata")
    assert repr(rel) in str(ei.value)
    with pytest.raises(dcp.api.CheckpointException) as ei2:
        dcp_load(fresh_like(_state()), mmapckpt.MmapReader(ckpt))
    assert "leaves the checkpoint directory" in str(dcp_failure(ei2.value))


def test_symlinked_shard_leaving_the_directory(ckpt: Path, tmp_path) -> None:
    outside = tmp_path / "outside.distcp"
    (ckpt / SHARD).rename(outside)
    (ckpt / SHARD).symlink_to(outside)
    err = load_failure(ckpt)
    assert type(err) is mmapckpt.UnsafePathError
    assert_names(err, ckpt)
    assert str(outside) in str(err)


def test_path_traversal_in_stock_metadata(tmp_path) -> None:
    """Stock (pickled) metadata naming a path outside is refused too, after the restricted unpickle."""
    path = tmp_path / "stock"
    dcp_save(_state(), FileSystemWriter(path))
    md = mmapckpt.MmapReader(path).read_metadata()
    for idx, info in list(md.storage_data.items()):
        md.storage_data[idx] = type(info)("../../x.distcp", info.offset, info.length)
    md.storage_meta = None
    import pickle
    (path / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(mmapckpt.UnsafePathError) as ei:
        mmapckpt.MmapReader(path).read_metadata()
    assert_names(ei.value, path / ".metadata")


# --------------------------------------------------------------------------- damaged metadata
@pytest.mark.parametrize("damage", ["empty", "truncated", "garbage", "flipped-bit", "not-json"])
def test_damaged_metadata(ckpt: Path, damage: str) -> None:
    meta = ckpt / ".metadata"
    raw = meta.read_bytes()
    if damage == "empty":
        meta.write_bytes(b"")
    elif damage == "truncated":
        meta.write_bytes(raw[: len(raw) // 2])
    elif damage == "garbage":
        meta.write_bytes(b"hello world, not metadata")
    elif damage == "flipped-bit":
        meta.write_bytes(raw[:30] + bytes([raw[30] ^ 1]) + raw[31:])
    else:
        body = b"{not json"
        meta.write_bytes(raw[:12] + struct.pack("<IQ", zlib.crc32(body), len(body)) + body)
    with pytest.raises(mmapckpt.FormatError) as ei:
        mmapckpt.MmapReader(ckpt).read_metadata()
    assert_names(ei.value, meta)
    with pytest.raises(dcp.api.CheckpointException):
        dcp_load(fresh_like(_state()), mmapckpt.MmapReader(ckpt))


def test_errors_survive_pickling(ckpt: Path) -> None:
    """DCP gathers failures across ranks by pickling them: type, path and entry must survive."""
    import pickle
    (ckpt / SHARD).write_bytes(b"")
    err = load_failure(ckpt)
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is type(err) and back.path == err.path and back.entry == err.entry and str(back) == str(err)


def test_shards_of_another_save_are_refused(tmp_path) -> None:
    """An old .metadata paired with the shards of a later save (same names, same layout) must not
    load the later save's bytes as if they were the old ones."""
    path = tmp_path / "c"
    old = {"w": torch.full((10,), 1.0)}
    dcp_save(old, mmapckpt.MmapWriter(path, sync_files=False))
    old_meta = (path / ".metadata").read_bytes()
    dcp_save({"w": torch.full((10,), 2.0)}, mmapckpt.MmapWriter(path, sync_files=False))
    (path / ".metadata").write_bytes(old_meta)
    err = load_failure(path, targets={"w": torch.zeros(10)})
    assert type(err) is mmapckpt.IncompleteCheckpointError, f"{type(err).__name__}: {err}"
    assert_names(err, path / SHARD)
