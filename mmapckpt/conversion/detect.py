"""Which format a path holds, and the conversion source that reads it."""

from __future__ import annotations

import json
import os
import zipfile

from ..errors import CheckpointError, CheckpointNotFoundError, FormatError
from ..format.metadata import KIND_MMAPCKPT, METADATA_NAME, find_metadata, metadata_kind, read_metadata_file
from ..io.files import open_inside
from .common import SAFETENSORS_INDEX, SAFETENSORS_SINGLE, Source
from .flat import SafetensorsSource, TorchSource
from .sources import MmapckptSource, StockSource

__all__ = ["detect_format", "open_source"]


def _safetensors_index(path: str) -> dict[str, list[str]]:
    idx_path = _index_file(path)
    if idx_path is None:
        raise CheckpointNotFoundError("no *.safetensors.index.json here", path=path)
    try:
        with open(idx_path, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:
        raise FormatError(f"unreadable safetensors index: {e}", path=idx_path) from None
    wm = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(wm, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in wm.items()):
        raise FormatError("safetensors index has no 'weight_map' of name -> file", path=idx_path)
    files: dict[str, list[str]] = {}
    for name, rel in wm.items():
        full = open_inside(path, rel)
        if not os.path.isfile(full):
            raise CheckpointError("shard file named in the index is missing", path=full, entry=name)
        files.setdefault(full, []).append(name)
    return files


def _index_file(path: str) -> str | None:
    """The directory's safetensors index: model.safetensors.index.json, else the only *.safetensors.index.json."""
    if os.path.isfile(os.path.join(path, SAFETENSORS_INDEX)):
        return os.path.join(path, SAFETENSORS_INDEX)
    found = sorted(n for n in os.listdir(path) if n.endswith(".safetensors.index.json"))
    return os.path.join(path, found[0]) if len(found) == 1 else None


def _looks_like_safetensors(path: str) -> bool:
    with open(path, "rb") as f:
        head = f.read(9)
    if len(head) < 9:
        return False
    n = int.from_bytes(head[:8], "little")
    return head[8:9] == b"{" and 2 <= n <= os.path.getsize(path) - 8


def detect_format(path: str | os.PathLike[str]) -> str:
    """The format of the checkpoint at ``path``: one of FORMATS.

    Raises:
        CheckpointNotFoundError: nothing there, or nothing recognisable.
        IncompleteCheckpointError: DCP shards without committed metadata.
    """
    p = os.fspath(path)
    if os.path.isdir(p):
        if os.path.isfile(os.path.join(p, METADATA_NAME)):
            with open(os.path.join(p, METADATA_NAME), "rb") as f:
                head = f.read(8)
            kind = metadata_kind(head)
            if kind is None:
                raise FormatError("neither mmapckpt nor stock DCP metadata", path=os.path.join(p, METADATA_NAME))
            return kind
        if _index_file(p) is not None or os.path.isfile(os.path.join(p, SAFETENSORS_SINGLE)):
            return "safetensors"
        find_metadata(p)  # raises IncompleteCheckpointError or CheckpointNotFoundError
    if not os.path.exists(p):
        raise CheckpointNotFoundError("no such file or directory", path=p)
    if not os.path.isfile(p):
        raise CheckpointNotFoundError("not a checkpoint file or directory", path=p)
    if p.endswith(".safetensors") or _looks_like_safetensors(p):
        return "safetensors"
    with open(p, "rb") as f:
        head = f.read(2)
    if zipfile.is_zipfile(p) or head[:1] == b"\x80":
        return "torch"
    raise CheckpointNotFoundError("not a recognised checkpoint (mmapckpt, DCP, safetensors or torch.save)", path=p)


def open_source(path: str | os.PathLike[str]) -> Source:
    """Open the checkpoint at ``path`` (any format of FORMATS) for reading."""
    p = os.fspath(path)
    if os.path.basename(p) == METADATA_NAME and os.path.isfile(p):
        p = os.path.dirname(p) or "."
    kind = detect_format(p)
    if kind in ("mmapckpt", "dcp"):
        got, md = read_metadata_file(find_metadata(p))
        return MmapckptSource(p, md) if got == KIND_MMAPCKPT else StockSource(p, md)
    if kind == "safetensors":
        if os.path.isdir(p) and _index_file(p) is None:  # a Hugging Face directory with one model.safetensors
            return SafetensorsSource(p, {os.path.join(p, SAFETENSORS_SINGLE): []})
        return SafetensorsSource(p, _safetensors_index(p) if os.path.isdir(p) else {p: []})
    return TorchSource(p)
