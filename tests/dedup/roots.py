"""Managed roots for the dedup tests: a marker, steps saved with and without ``reuse``, their files, and state dicts
whose tensors stay, change once or change every step."""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from mmapckpt import MmapWriter
from mmapckpt.format.entries import ROOT_MARKER

MARKER = json.dumps({"format": "mmapckpt-root", "version": 1})


def make_root(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / ROOT_MARKER).write_text(MARKER)
    return root


def save_step(root: Any, step: int, sd: dict[str, Any], reuse: tuple[int, ...] = (), **kw: Any) -> MmapWriter:
    """``dcp.save`` of step ``step`` in ``root`` (a path or an s3:// URL), referring to the steps ``reuse``."""
    w = MmapWriter(f"{root}/step-{step}", overwrite=False, reuse=[f"{root}/step-{m}" for m in reuse], **kw)
    dcp.save(sd, storage_writer=w, no_dist=True)
    return w


def metadata_doc(step_dir: Path) -> dict[str, Any]:
    raw = (step_dir / ".metadata").read_bytes()
    return json.loads(raw[24:])


def write_metadata_doc(step_dir: Path, doc: dict[str, Any]) -> None:
    """Replace a step's ``.metadata`` body by ``doc`` (checksum and length made to match; a minor version 1)."""
    raw = (step_dir / ".metadata").read_bytes()
    body = json.dumps(doc, separators=(",", ":")).encode()
    (step_dir / ".metadata").write_bytes(raw[:12] + struct.pack("<IQ", zlib.crc32(body), len(body)) + body)


def files_of(step_dir: Path) -> dict[str, str]:
    """Each tensor's file as the step's metadata names it (the first chunk's)."""
    from mmapckpt.storage.commits import read_index_file
    _, entries, _ = read_index_file(step_dir / ".metadata")
    return {k: e.chunks[0].file for k, e in entries.items() if e.kind == "tensor" and e.chunks}


def shard_bytes(step_dir: Path) -> int:
    return sum(p.stat().st_size for p in step_dir.glob("*.distcp"))


def frozen_and_trained(seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"frozen.w": torch.randn(256, 64, generator=g), "frozen.b": torch.randn(64, generator=g).bfloat16(),
            "head.w": torch.randn(64, 8, generator=g), "step": seed}


def late_frozen(step: int) -> dict[str, Any]:
    """frozen.*: the same from step 1 on; late.w: changes from step 1 to 2, then the same; head.w: new every step."""
    g = torch.Generator().manual_seed(0)
    sd: dict[str, Any] = {"frozen.w": torch.randn(256, 256, generator=g),  # 256 KiB: past the 64 KiB head
                          "frozen.b": torch.randn(64, generator=g).bfloat16()}
    sd["late.w"] = torch.randn(256, 256, generator=torch.Generator().manual_seed(min(step, 2)))
    sd["head.w"] = torch.full((64, 8), float(step))
    return sd
