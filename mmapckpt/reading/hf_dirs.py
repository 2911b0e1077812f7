"""Which files of a Hugging Face style directory hold a checkpoint: its index, its one file, or (neither
there) every ``*.safetensors`` file of the directory.

The rule (docs/lazy.md, "Formats"), the same for every reader (``open``/``load``/``load_into``/
``load_model``, ``MmapReader``, ``convert``, ``inspect``, ``verify``):

- ``model.safetensors.index.json`` (or the directory's only ``*.safetensors.index.json``): the files its
  ``weight_map`` names, each holding the tensors it puts there; a shard of the index's series that the
  index never names is refused;
- else ``model.safetensors``: that file alone (adapters and other ``*.safetensors`` beside it are not
  the model's);
- else ``pytorch_model.bin.index.json`` / ``pytorch_model.bin``: the same, of ``torch.save`` files;
- else every ``*.safetensors`` file of the directory, read as their union: a PEFT adapter directory
  (``adapter_model.safetensors`` beside ``adapter_config.json``), or what
  ``HuggingFaceStorageWriter`` leaves without an index. A name in two files is refused naming both,
  unless their headers' ``DCP_SHARDING_INFO`` place it as distinct chunks of one tensor (a distributed
  ``HuggingFaceStorageWriter`` save), which are read together.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from ..errors import CheckpointError, CheckpointNotFoundError, FormatError, IncompleteCheckpointError
from ..storage.base import CheckpointStorage
from .located import Place

__all__ = ["SAFETENSORS_INDEX", "SAFETENSORS_SINGLE", "SAFETENSORS_SUFFIX", "TORCH_INDEX", "TORCH_SINGLE",
           "MAX_INDEX_SIZE", "index_name", "indexed_files", "listed_safetensors", "HF_NAMES"]

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"  # the one file of an unsharded Hugging Face model directory
SAFETENSORS_SUFFIX = ".safetensors"
TORCH_INDEX = "pytorch_model.bin.index.json"  # the same index, of torch.save shards
TORCH_SINGLE = "pytorch_model.bin"
#: Per kind of Hugging Face directory: its index, the ending of any other index, its one unsharded file.
HF_NAMES = {"safetensors": (SAFETENSORS_INDEX, ".safetensors.index.json", SAFETENSORS_SINGLE),
            "torch": (TORCH_INDEX, ".bin.index.json", TORCH_SINGLE)}
#: The largest index read (real ones are tens of KiB).
MAX_INDEX_SIZE = 64 << 20

Files = dict[str, "list[str] | None"]


def index_name(storage: CheckpointStorage, kind: str = "safetensors") -> str | None:
    """The directory's index of ``kind`` files: model.safetensors.index.json, else the only
    *.safetensors.index.json (``kind="torch"``: pytorch_model.bin.index.json, else the only *.bin.index.json)."""
    index, ending, _ = HF_NAMES[kind]
    if storage.exists(index):
        return index
    found = sorted(n for n in storage.list() if n.endswith(ending))
    return found[0] if len(found) == 1 else None


def listed_safetensors(storage: CheckpointStorage) -> list[str]:
    """Every ``*.safetensors`` file of the directory, sorted (the files of a directory without index or
    ``model.safetensors``)."""
    return sorted(n for n in storage.list() if n.endswith(SAFETENSORS_SUFFIX))


def _pairs_once(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        raise ValueError(f"the name {dup!r} appears twice")
    return out


def _read_index(place: Place, rel: str) -> dict[str, str]:
    full = place.full(rel)
    try:
        data = place.storage.read_file(rel, MAX_INDEX_SIZE)
        doc = json.loads(bytes(data).decode("utf-8"), object_pairs_hook=_pairs_once)
    except FormatError as e:
        raise FormatError(f"unreadable index: {e.args[0]}", path=full) from None
    except (OSError, ValueError, RecursionError) as e:
        raise FormatError(f"unreadable index: {e}", path=full) from None
    wm = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(wm, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in wm.items()):
        raise FormatError("index has no 'weight_map' of name -> file", path=full)
    _no_impossible_file_names(wm, full)
    return wm


def _impossible_file_name(name: str) -> str | None:
    """Why ``name``, a file name an index gives, can name no file on any medium (else None)."""
    if not name:
        return "is empty"
    if "\x00" in name:
        return "holds a NUL byte"
    if name.endswith("/"):
        return "names a directory"
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return "holds a lone surrogate, which no UTF-8 name can"
    return None


def _no_impossible_file_names(weight_map: Mapping[str, str], full: str) -> None:
    """Refuse an index whose ``weight_map`` gives a file name that no file can have, naming the index and the
    entry (the file system would raise an untyped ValueError naming neither)."""
    for given in set(weight_map.values()):
        why = _impossible_file_name(given)
        if why is not None:
            entry = next(k for k, v in weight_map.items() if v == given)
            raise FormatError(f"the index's weight_map gives this tensor's file as {given!r}, which {why}: no "
                              "file can have that name. Fix the index (or restore it from the model's source)",
                              path=full, entry=entry)


def indexed_files(place: Place, kind: str, *, listing: bool = False) -> tuple[Files, str | None]:
    """``({name of each file: the tensors the index puts there, or None for all}, the index's name)`` of a
    Hugging Face directory of ``kind`` ("safetensors" or "torch") files, or of the one file ``place`` names;
    names are relative to ``place.root`` (``place.full(name)`` gives the full one, ``place.open(name)`` the file).
    ``listing`` (safetensors only): without an index or the one file, every ``*.safetensors`` file.

    A directory's index, its one file (``model.safetensors``, ``pytorch_model.bin``) and the files the index
    names must resolve inside the directory (locally: or be links into the ``blobs/`` of the hub cache whose
    snapshot it is).

    Raises:
        CheckpointNotFoundError: a directory without an index or the one file (or, ``listing``, any).
        FormatError, CheckpointError: a damaged index, or a file it names outside the directory.
        IncompleteCheckpointError: a file it names is missing.
    """
    if place.name is not None:
        return {place.name: None}, None
    index, _, single = HF_NAMES[kind]
    idx = index_name(place.storage, kind)
    if idx is None:
        if place.exists(single):
            return {place.inside(single): None}, None
        listed = listed_safetensors(place.storage) if listing else []
        if not listed:
            raise CheckpointNotFoundError(f"no {index} or {single} here", path=place.path)
        return {place.inside(n): None for n in listed}, None
    idx = place.inside(idx)
    files: Files = {}
    checked: dict[str, str] = {}  # each file checked once, not once per tensor (a realpath costs ~70 us)
    for name, given in _read_index(place, idx).items():
        rel = checked.get(given)
        if rel is None:
            rel = place.inside(given)
            if not place.exists(rel):
                raise IncompleteCheckpointError("shard file named in the index is missing", path=place.full(rel),
                                                entry=name)
            checked[given] = rel
        files.setdefault(rel, []).append(name)  # type: ignore[union-attr]
    _no_unnamed_shards(place, files)
    return files, idx


#: A shard's name as Hugging Face numbers them: model-00001-of-00003.safetensors, pytorch_model-00002-of-00003.bin.
_SHARD = r"(.+)-\d{5}-of-(\d{5})(\.[^/]+)"  # compiled by re on first use (a Hugging Face directory's)


def _no_unnamed_shards(place: Place, files: Mapping[str, Any]) -> None:
    """Refuse a shard of the index's series (same stem, count and ending) that the index never names: its tensors
    would be silently left out."""
    series = {(m[1], m[2], m[3]) for rel in files if (m := re.fullmatch(_SHARD, rel))}
    if not series:
        return
    for name in sorted(place.storage.list()):
        m = re.fullmatch(_SHARD, name)
        if m and (m[1], m[2], m[3]) in series and name not in files:
            raise CheckpointError("shard file the index never names: its tensors would be left out. Restore the "
                                  "index that names it, or move the file away", path=place.full(name))
