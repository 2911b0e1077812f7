"""Cross-step references that leave the root, or name bytes of another save, are refused the same way
through every entry point (``open``, ``load``, ``load_into``, ``load_model``, ``dcp.load``, ``convert``,
``inspect``, ``verify``), with a typed CheckpointError naming the file; and ``reuse=`` refuses what it
cannot refer to before anything is written."""

from __future__ import annotations

import json
import os
import shutil
import struct
import sys
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

import mmapckpt
from mmapckpt.errors import (ChecksumError, CheckpointWriteError, IncompleteCheckpointError, TruncatedFileError,
                             UnsafePathError)
from mmapckpt.format.entries import ROOT_MARKER
from helpers import shard_with_header
from roots import make_root, metadata_doc, save_step, write_metadata_doc

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "reliability"))
from test_same_damage import ENTRY_POINTS, VERIFYING, Reported, _state  # noqa: E402

SHARD = "__0_0.distcp"
REF = f"../step-1/{SHARD}"


def _steps(tmp: Path) -> Path:
    """Step 1, and step 2 whose ``weight`` refers to step 1's bytes (its ``bias`` changed)."""
    root = make_root(tmp / "root")
    sd = _state()
    save_step(root, 1, sd)
    sd2 = dict(sd, bias=sd["bias"] + 1)
    save_step(root, 2, sd2, reuse=(1,))
    assert REF in metadata_doc(root / "step-2")["table"]["files"]
    return root


def _renamed(name: str) -> Callable[[Path], Path]:
    """The step's reference to step 1's shard renamed to ``name`` (listed in ``references`` under that name)."""
    def damage(root: Path) -> Path:
        step = root / "step-2"
        doc = metadata_doc(step)
        files = doc["table"]["files"]
        files[files.index(REF)] = name
        refs = doc["storage_meta"]["references"]
        refs[name] = refs.pop(REF)
        write_metadata_doc(step, doc)
        return step / ".metadata"
    return damage


def _unlisted(root: Path) -> Path:
    doc = metadata_doc(root / "step-2")
    del doc["storage_meta"]["references"]
    write_metadata_doc(root / "step-2", doc)
    return root / "step-2" / ".metadata"


def _no_root(root: Path) -> Path:
    (root / ROOT_MARKER).unlink()
    return root / "step-2"


def _linked_step(root: Path) -> Path:
    outside = root.parent / "elsewhere"
    shutil.move(root / "step-1", outside)
    os.symlink(outside, root / "step-1")
    return root / "step-1"


def _other_save(root: Path) -> Path:
    save_step(root, 3, _state())  # the same values, another save id
    shutil.copyfile(root / "step-3" / SHARD, root / "step-1" / SHARD)
    return root / "step-1" / SHARD


def _no_save_id(root: Path) -> Path:
    """Step 1's shard with its header's save id removed (a file no save id ties to the step referring to it)."""
    target = root / "step-1" / SHARD
    data = target.read_bytes()
    doc = json.loads(data[32:32 + struct.unpack_from("<Q", data, 16)[0]])
    del doc["save_id"]
    target.write_bytes(shard_with_header(data, doc, compact=True))
    return target


def _weight(root: Path) -> tuple[Path, int, int]:
    from mmapckpt.storage.commits import read_index_file
    _, entries, _ = read_index_file(root / "step-2" / ".metadata")
    (c,) = entries["weight"].chunks
    return root / "step-2" / c.file, c.file_offset, c.length


def _truncated(root: Path) -> Path:
    target, offset, length = _weight(root)
    os.truncate(target, offset + length // 2)
    return root / "step-1" / SHARD


def _missing(root: Path) -> Path:
    (root / "step-1" / SHARD).unlink()
    return root / "step-1" / SHARD


def _flipped(root: Path) -> Path:
    target, offset, length = _weight(root)
    with open(target, "r+b") as f:
        f.seek(offset + length // 2)
        b = f.read(1)
        f.seek(offset + length // 2)
        f.write(bytes([b[0] ^ 0x10]))
    return root / "step-1" / SHARD


ALL = tuple(ENTRY_POINTS)
#: damage -> (how, the one error class, the entry points)
DAMAGES: dict[str, tuple[Callable[[Path], Path], type, tuple[str, ...]]] = {
    "outside-a-root": (_no_root, UnsafePathError, ALL),
    "up-twice": (_renamed(f"../../{SHARD}"), UnsafePathError, ALL),
    "up-through-a-step": (_renamed(f"../step-1/../../{SHARD}"), UnsafePathError, ALL),
    "absolute": (_renamed(f"/tmp/{SHARD}"), UnsafePathError, ALL),
    "not-a-step": (_renamed(f"../notastep/{SHARD}"), UnsafePathError, ALL),
    "itself": (lambda root: _renamed(f"../step-2/{SHARD}")(root).parent, UnsafePathError, ALL),
    "not-listed": (_unlisted, UnsafePathError, ALL),
    "linked-step": (_linked_step, UnsafePathError, ALL),
    "other-save": (_other_save, IncompleteCheckpointError, ALL),
    "no-save-id": (_no_save_id, IncompleteCheckpointError, ALL),
    "truncated": (_truncated, TruncatedFileError, ALL),
    "missing": (_missing, IncompleteCheckpointError, ALL),
    "flipped": (_flipped, ChecksumError, VERIFYING),
}
CASES = [(d, e) for d, (_, _, entries) in DAMAGES.items() for e in entries]


def _outcome(damage: str, entry: str, tmp: Path) -> tuple[str, str, str]:
    root = _steps(tmp)
    named = DAMAGES[damage][0](root)
    try:
        ENTRY_POINTS[entry](root / "step-2", tmp, damage == "flipped")
    except Reported as e:
        return e.error, str(e), named.name
    except mmapckpt.CheckpointError as e:
        return type(e).__name__, str(e), named.name
    return "no error", "", named.name


@pytest.mark.parametrize("damage,entry", CASES, ids=[f"{d}-{e}" for d, e in CASES])
def test_a_hostile_reference_raises_the_same_error_everywhere(damage: str, entry: str, tmp_path: Path) -> None:
    error, message, name = _outcome(damage, entry, tmp_path)
    want = DAMAGES[damage][1].__name__
    assert error == want, f"{damage} through {entry}: {error} ({message}), want {want}"
    assert name in message, f"{damage} through {entry}: the message does not name {name}: {message}"


# --------------------------------------------------------------------------- reuse= refuses before writing
def _refused(tmp: Path, reuse: list[Any], *, marker: bool = True) -> str:
    root = make_root(tmp / "root")
    save_step(root, 1, _state())
    if not marker:
        (root / ROOT_MARKER).unlink()
    with pytest.raises(BaseException) as info:
        w = mmapckpt.MmapWriter(root / "step-2", overwrite=False, reuse=reuse)
        torch.distributed.checkpoint.save(_state(), storage_writer=w, no_dist=True)
    e = info.value
    e = next(iter(e.failures.values())) if hasattr(e, "failures") else e
    e = e[0] if isinstance(e, tuple) else e
    assert isinstance(e, CheckpointWriteError), repr(e)
    assert not list((root / "step-2").glob("*.distcp")) and not (root / "step-2" / ".metadata").exists()
    return str(e)


def test_reuse_outside_a_root_is_refused(tmp_path: Path) -> None:
    assert ROOT_MARKER in _refused(tmp_path, [tmp_path / "root" / "step-1"], marker=False)


def test_reuse_of_a_step_of_another_root_is_refused(tmp_path: Path) -> None:
    other = make_root(tmp_path / "other")
    save_step(other, 1, _state())
    assert "not in this step's root" in _refused(tmp_path, [other / "step-1"])


def test_reuse_of_the_step_itself_or_of_no_step_is_refused(tmp_path: Path) -> None:
    assert "not a sibling step" in _refused(tmp_path / "a", [tmp_path / "a" / "root" / "step-2"])
    assert "not a sibling step" in _refused(tmp_path / "b", [tmp_path / "b" / "root" / "notes"])


def test_reuse_without_blake3_fails_clearly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "blake3", None)  # import blake3 raises ImportError
    assert "pip install 'mmapckpt[dedup]'" in _refused(tmp_path, [tmp_path / "root" / "step-1"])


def test_reuse_takes_a_list_of_raw_steps() -> None:
    with pytest.raises(TypeError, match="list of step paths"):
        mmapckpt.MmapWriter("/nonexistent/root/step-2", reuse="/nonexistent/root/step-1")
    from torch.distributed.checkpoint._extension import ZStandard
    with pytest.raises(ValueError, match="_extensions"):
        mmapckpt.MmapWriter("/nonexistent/root/step-2", reuse=["/nonexistent/root/step-1"], _extensions=[ZStandard()])
