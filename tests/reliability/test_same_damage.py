"""The same damage raises the same error class through every entry point.

Each damage (a shard of another save, a truncated shard, a missing shard, a flipped data byte
read with verification) is made to an mmapckpt checkpoint and, where the format can have it, to
a stock DCP checkpoint and a Hugging Face directory of safetensors files. Every entry point
(``open`` + ``get_tensor``, ``load``, ``load_into``, ``load_model``, ``dcp.load`` with
``MmapReader`` unwrapped by ``checkpoint_error``, ``convert``, ``inspect``, ``verify``) must
raise (``verify``: report) one and the same CheckpointError subclass for it, naming the file.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter

import mmapckpt
from mmapckpt.errors import ChecksumError, IncompleteCheckpointError, TruncatedFileError
from mmapckpt.storage.commits import read_index_file

SHAPES = {"weight": (32, 16), "bias": (32,)}


def _model() -> nn.Linear:
    torch.manual_seed(3)
    return nn.Linear(16, 32)


def _state() -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in _model().state_dict().items()}


def _save(fmt: str, d: Path) -> None:
    sd = _state()
    if fmt == "mmapckpt":
        mmapckpt.save(sd, d)
    elif fmt == "dcp":
        dcp.save(sd, storage_writer=FileSystemWriter(d), no_dist=True)
    else:  # a Hugging Face directory: an index and two shards, one tensor each
        d.mkdir()
        names = {"weight": "model-00001-of-00002.safetensors", "bias": "model-00002-of-00002.safetensors"}
        for k, rel in names.items():
            save_file({k: sd[k]}, d / rel)
        (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": names}))


def _data_file(fmt: str, d: Path) -> Path:
    """The file the damage is done to: the one holding ``weight``."""
    if fmt == "safetensors":
        return d / "model-00001-of-00002.safetensors"
    (shard,) = glob.glob(os.path.join(d, "*.distcp"))
    return Path(shard)


# --------------------------------------------------------------------------- damages: (format, dir) -> damaged file
def _other_save(fmt: str, d: Path) -> Path:
    other = d.parent / "other"
    _save(fmt, other)  # the same state dict, saved again: a new save id
    target = _data_file(fmt, d)
    shutil.copyfile(_data_file(fmt, other), target)
    return target


def _weight_bytes(fmt: str, d: Path) -> tuple[Path, int, int]:
    """The file holding ``weight`` and where its bytes are in it (an mmapckpt shard pads its data: the damage
    must hit the tensor, not the padding)."""
    target = _data_file(fmt, d)
    if fmt != "mmapckpt":
        size = os.path.getsize(target)
        return target, size - 600, 600
    _, entries, _ = read_index_file(d / ".metadata")
    (c,) = entries["weight"].chunks
    return d / c.file, c.file_offset, c.length


def _truncated(fmt: str, d: Path) -> Path:
    target, offset, length = _weight_bytes(fmt, d)
    os.truncate(target, offset + length // 2)
    return target


def _missing(fmt: str, d: Path) -> Path:
    target = _data_file(fmt, d)
    target.unlink()
    return target


def _flipped(fmt: str, d: Path) -> Path:
    target, offset, length = _weight_bytes(fmt, d)
    with open(target, "r+b") as f:  # one bit in the middle of ``weight``'s data
        f.seek(offset + length // 2)
        b = f.read(1)
        f.seek(offset + length // 2)
        f.write(bytes([b[0] ^ 0x10]))
    return target


# --------------------------------------------------------------------------- entry points: (dir, tmp, verify) -> None
def _open(d: Path, tmp: Path, verify: bool) -> None:
    with mmapckpt.open(d, verify=verify) as f:
        for k in f.keys():
            f.get_tensor(k).sum()


def _load(d: Path, tmp: Path, verify: bool) -> None:
    for t in mmapckpt.load(d, verify=verify).values():
        t.sum()


def _load_into(d: Path, tmp: Path, verify: bool) -> None:
    mmapckpt.load_into({k: torch.empty(s) for k, s in SHAPES.items()}, d)


def _load_model(d: Path, tmp: Path, verify: bool) -> None:
    mmapckpt.load_model(_model(), d)


def _dcp_load(d: Path, tmp: Path, verify: bool) -> None:
    reader = mmapckpt.MmapReader(d, verify=verify)
    try:
        dcp.load({k: torch.empty(s) for k, s in SHAPES.items()}, storage_reader=reader, no_dist=True)
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        raise mmapckpt.checkpoint_error(e, reader) from e


def _convert(d: Path, tmp: Path, verify: bool) -> None:
    mmapckpt.convert(d, tmp / "out.safetensors")


def _inspect(d: Path, tmp: Path, verify: bool) -> None:
    mmapckpt.inspect_checkpoint(d)


class Reported(Exception):
    """What ``verify`` reported, as the error class its first problem names."""

    def __init__(self, error: str, message: str) -> None:
        super().__init__(message)
        self.error = error


def _verify(d: Path, tmp: Path, verify: bool) -> None:
    report = mmapckpt.verify_checkpoint(d)
    if report.problems:
        p = report.problems[0]
        raise Reported(p.error, str(p))


ENTRY_POINTS: dict[str, Callable[[Path, Path, bool], None]] = {
    "open": _open, "load": _load, "load_into": _load_into, "load_model": _load_model, "dcp.load": _dcp_load,
    "convert": _convert, "inspect": _inspect, "verify": _verify}
#: entry points that can check a checksum (convert and verify always do): the flipped byte's
VERIFYING = ("open", "load", "dcp.load", "convert", "verify")

#: damage -> (how, the formats it applies to, the one error class, the entry points it applies to)
DAMAGES: dict[str, tuple[Callable[[str, Path], Path], tuple[str, ...], type, tuple[str, ...]]] = {
    # stock DCP shards and safetensors files carry no save id: a shard of another save is invisible there
    "other-save": (_other_save, ("mmapckpt",), IncompleteCheckpointError, tuple(ENTRY_POINTS)),
    "truncated": (_truncated, ("mmapckpt", "dcp", "safetensors"), TruncatedFileError, tuple(ENTRY_POINTS)),
    "missing": (_missing, ("mmapckpt", "dcp", "safetensors"), IncompleteCheckpointError, tuple(ENTRY_POINTS)),
    # only mmapckpt has checksums; inspect reads no data
    "flipped": (_flipped, ("mmapckpt",), ChecksumError, VERIFYING),
}

CASES = [(damage, fmt, entry) for damage, (_, fmts, _, entries) in DAMAGES.items() for fmt in fmts
         for entry in entries]


def _outcome(damage: str, fmt: str, entry: str, tmp: Path) -> tuple[str, str, str]:
    """(the error class raised or reported, its message, the damaged file's name)."""
    d = tmp / "ckpt"
    _save(fmt, d)
    damaged = DAMAGES[damage][0](fmt, d)
    try:
        ENTRY_POINTS[entry](d, tmp, damage == "flipped")
    except Reported as e:
        return e.error, str(e), damaged.name
    except mmapckpt.CheckpointError as e:
        return type(e).__name__, str(e), damaged.name
    return "no error", "", damaged.name


@pytest.mark.parametrize("damage,fmt,entry", CASES, ids=[f"{d}-{f}-{e}" for d, f, e in CASES])
def test_same_damage_same_error(damage: str, fmt: str, entry: str, tmp_path: Path) -> None:
    error, message, name = _outcome(damage, fmt, entry, tmp_path)
    want = DAMAGES[damage][2].__name__
    assert error == want, f"{damage} of a {fmt} checkpoint through {entry}: {error} ({message}), want {want}"
    assert name in message, f"{damage} of a {fmt} checkpoint through {entry}: the message does not name {name}"
