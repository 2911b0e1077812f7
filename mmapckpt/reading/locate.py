"""Which checkpoint format a path or URL holds, and its files opened for lazy reading.

One detection for every reader (``open``/``load``/``load_into``, ``convert``, ``inspect``,
``verify``), on a local path or a URL of any registered medium (reading/located.py: a URL
names a directory where files exist under it, else a file):

- a directory with ``.metadata``: an mmapckpt or a stock DCP checkpoint (the metadata's
  first bytes tell which);
- a directory with ``model.safetensors.index.json`` (or exactly one ``*.safetensors.index.json``):
  a Hugging Face sharded model; its ``weight_map`` names each tensor's file;
- a directory with ``model.safetensors`` and no index: a Hugging Face model in one file
  (``config.json`` and tokenizer files beside it are ignored);
- a directory with ``pytorch_model.bin.index.json`` (or exactly one ``*.bin.index.json``) or
  ``pytorch_model.bin``, and no safetensors weights (which win where both are there, as
  ``transformers`` picks them): a Hugging Face model of ``torch.save`` files, its index read by
  the same code as a safetensors index;
- a file that is a safetensors file (by its name or its first bytes), or a ``torch.save``
  file (a zip archive or a pickle).

Every file is read through the storage (``storage/base.py``): on a medium without mappings a
safetensors tensor is read by range (``read_into``) and a torch.save file whole into memory.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from ..errors import CheckpointError, CheckpointNotFoundError, FormatError
from ..format.entries import EntryInfo
from ..format.metadata import METADATA_NAME
from ..format.safetensors import entry_infos
from ..storage.base import CheckpointStorage
from ..storage.commits import read_index, read_user_metadata
from .backend import ChunkBackend
from .chunks import ChunkFiles
from .located import Place, locate
from .safetensors_files import SafetensorsFile, SafetensorsFiles, is_safetensors_file
from .torchfile import TorchFiles, is_torch_file

__all__ = [
    "FORMATS",
    "SAFETENSORS_INDEX",
    "SAFETENSORS_SINGLE",
    "TORCH_INDEX",
    "TORCH_SINGLE",
    "Opened",
    "detect_format",
    "directory_kind",
    "index_name",
    "indexed_files",
    "locate_checkpoint",
    "open_backend",
    "place_format",
    "safetensors_files",
]

FORMATS = ("mmapckpt", "dcp", "safetensors", "torch")
SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"  # the one file of an unsharded Hugging Face model directory
TORCH_INDEX = "pytorch_model.bin.index.json"  # the same index, of torch.save shards
TORCH_SINGLE = "pytorch_model.bin"
#: Per format of a Hugging Face directory: its index, the ending of any other index, its one unsharded file.
_HF_NAMES = {"safetensors": (SAFETENSORS_INDEX, ".safetensors.index.json", SAFETENSORS_SINGLE),
             "torch": (TORCH_INDEX, ".bin.index.json", TORCH_SINGLE)}
#: The largest safetensors index read (real ones are tens of KiB).
MAX_INDEX_SIZE = 64 << 20


def index_name(storage: CheckpointStorage, kind: str = "safetensors") -> str | None:
    """The directory's index of ``kind`` files: model.safetensors.index.json, else the only
    *.safetensors.index.json (``kind="torch"``: pytorch_model.bin.index.json, else the only *.bin.index.json)."""
    index, ending, _ = _HF_NAMES[kind]
    if storage.exists(index):
        return index
    found = sorted(n for n in storage.list() if n.endswith(ending))
    return found[0] if len(found) == 1 else None


def directory_kind(storage: CheckpointStorage) -> str | None:
    """``"safetensors"`` or ``"torch"`` for a Hugging Face model directory (safetensors weights win where it
    holds both), else None."""
    for kind, (_, _, single) in _HF_NAMES.items():
        if index_name(storage, kind) is not None or storage.exists(single):
            return kind
    return None


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


def safetensors_files(place: Place) -> tuple[dict[str, list[str] | None], str | None]:
    """:func:`indexed_files` of safetensors files."""
    return indexed_files(place, "safetensors")


def indexed_files(place: Place, kind: str) -> tuple[dict[str, list[str] | None], str | None]:
    """``({name of each file: the tensors the index puts there, or None for all}, the index's name)`` of a
    Hugging Face directory of ``kind`` ("safetensors" or "torch") files, or of the one file ``place`` names;
    names are relative to ``place.root`` (``place.full(name)`` gives the full one, ``place.open(name)`` the file).

    A directory's index, its one file (``model.safetensors``, ``pytorch_model.bin``) and the files the index
    names must resolve inside the directory (locally: or be links into the ``blobs/`` of the hub cache whose
    snapshot it is).

    Raises:
        CheckpointNotFoundError: a directory without an index or the one file.
        FormatError, CheckpointError: a damaged index, or a file it names that is missing or outside the directory.
    """
    if place.name is not None:
        return {place.name: None}, None
    index, _, single = _HF_NAMES[kind]
    idx = index_name(place.storage, kind)
    if idx is None:
        if not place.exists(single):
            raise CheckpointNotFoundError(f"no {index} or {single} here", path=place.path)
        return {place.inside(single): None}, None
    idx = place.inside(idx)
    files: dict[str, list[str] | None] = {}
    checked: dict[str, str] = {}  # each file checked once, not once per tensor (a realpath costs ~70 us)
    for name, given in _read_index(place, idx).items():
        rel = checked.get(given)
        if rel is None:
            rel = place.inside(given)
            if not place.exists(rel):
                raise CheckpointError("shard file named in the index is missing", path=place.full(rel), entry=name)
            checked[given] = rel
        files.setdefault(rel, []).append(name)  # type: ignore[union-attr]
    _no_unnamed_shards(place, files)
    return files, idx


#: A shard's name as Hugging Face numbers them: model-00001-of-00003.safetensors, pytorch_model-00002-of-00003.bin.
_SHARD = re.compile(r"(.+)-\d{5}-of-(\d{5})(\.[^/]+)")


def _no_unnamed_shards(place: Place, files: Mapping[str, Any]) -> None:
    """Refuse a shard of the index's series (same stem, count and ending) that the index never names: its tensors
    would be silently left out."""
    series = {(m[1], m[2], m[3]) for rel in files if (m := _SHARD.fullmatch(rel))}
    if not series:
        return
    for name in sorted(place.storage.list()):
        m = _SHARD.fullmatch(name)
        if m and (m[1], m[2], m[3]) in series and name not in files:
            raise CheckpointError("shard file the index never names: its tensors would be left out. Restore the "
                                  "index that names it, or move the file away", path=place.full(name))


def locate_checkpoint(path: str | os.PathLike[str], *,
                      storage_options: Mapping[str, Any] | None = None) -> Place:
    """Where ``path`` (a path or URL) names a checkpoint: :func:`located.locate`, with a ``.metadata`` file
    taken as its directory."""
    place = locate(path, options=storage_options)
    if place.name == METADATA_NAME:  # the commit file: its directory
        return place.directory()
    return place


def place_format(place: Place) -> str:
    """The format of the checkpoint at ``place``: one of FORMATS (see :func:`detect_format`)."""
    if place.name is None:
        storage = place.storage
        if storage.exists(METADATA_NAME):
            return storage.commit_kind(METADATA_NAME)
        kind = directory_kind(storage)
        if kind is not None:
            return kind
        try:
            storage.find_metadata()  # raises IncompleteCheckpointError (shards without a commit) or:
        except CheckpointNotFoundError:
            pass
        raise CheckpointNotFoundError(f"no checkpoint here: no {METADATA_NAME} (mmapckpt or DCP), "
                                      f"{SAFETENSORS_INDEX}, {SAFETENSORS_SINGLE}, {TORCH_INDEX} or {TORCH_SINGLE}",
                                      path=place.path)
    if place.name.endswith(".safetensors"):
        return "safetensors"
    with place.open() as f:
        if is_safetensors_file(f):
            return "safetensors"
        if is_torch_file(f):
            return "torch"
    raise CheckpointNotFoundError("not a recognised checkpoint (mmapckpt, DCP, safetensors or torch.save)",
                                  path=place.path)


def detect_format(path: str | os.PathLike[str], *, storage_options: Mapping[str, Any] | None = None) -> str:
    """The format of the checkpoint at ``path`` (a local path, or a URL of a registered medium): one of FORMATS.

    ``storage_options`` go to the medium of a URL (``storage/location.py`` ``storage_for``).

    Raises:
        CheckpointNotFoundError: nothing there, a URL of no registered medium, or nothing recognisable.
        IncompleteCheckpointError: DCP shards without committed metadata.
    """
    return place_format(locate(path, options=storage_options))


class Opened(NamedTuple):
    """A checkpoint opened for lazy reading.

    Attributes:
        kind: one of FORMATS.
        root: the directory that chunk file names are relative to.
        entries: the index, by name, in the checkpoint's order.
        files: the chunk backend (``ChunkFiles``, ``SafetensorsFiles`` or ``TorchFiles``: reading/backend.py).
        user_metadata: returns the ``{str: str}`` user metadata, or None where there is none.
    """

    kind: str
    root: str
    entries: dict[str, EntryInfo]
    files: ChunkBackend
    user_metadata: Callable[[], dict[str, str] | None]


def _no_metadata() -> None:
    return None


def _open_safetensors(place: Place) -> Opened:
    files, _ = safetensors_files(place)
    opened: dict[str, SafetensorsFile] = {}
    entries: dict[str, EntryInfo] = {}
    try:
        for rel, names in files.items():
            f = opened[rel] = SafetensorsFile(place.open(rel))
            for name, info in entry_infos(f.header, rel, names).items():
                if name in entries:  # only without an index: one file's header cannot name a tensor twice
                    raise FormatError("two files hold this tensor", path=place.full(rel), entry=name)
                entries[name] = info
    except BaseException:
        for f in opened.values():
            f.close()
        raise
    entries = {name: entries[name] for name in sorted(entries)}  # safe_open's keys() order
    metas = [f.header.metadata for f in opened.values()]

    def user_metadata() -> dict[str, str] | None:
        if all(m is None for m in metas):
            return None
        merged: dict[str, str] = {}
        for m in reversed(metas):  # an index's shards usually carry the same dict; the first file wins
            merged.update(m or {})
        return merged

    return Opened("safetensors", place.root, entries, SafetensorsFiles(place.root, opened), user_metadata)


def open_backend(path: str | os.PathLike[str], *, verify: bool = False,
                 storage_options: Mapping[str, Any] | None = None) -> Opened:
    """Open the checkpoint at ``path`` (any of FORMATS; a local path or a URL) for lazy reading; see :class:`Opened`.

    ``verify`` turns on the CRC-32 check of mmapckpt entries; the other formats have no
    checksums (their structure is checked on open whatever ``verify`` says). ``storage_options``
    go to the medium of a URL (``storage/location.py`` ``storage_for``).
    """
    place = locate_checkpoint(path, storage_options=storage_options)
    kind = place_format(place)
    if kind == "safetensors":
        return _open_safetensors(place)
    if kind == "torch":
        files, entries = TorchFiles.open(place, indexed_files(place, kind)[0])
        return Opened(kind, place.root, entries, files, _no_metadata)
    storage = place.storage
    meta = storage.find_metadata()
    kind, entries, save_id = read_index(storage, meta)
    read: list[dict[str, str] | None] = []

    def user_metadata() -> dict[str, str] | None:  # read on first use: open() itself decodes the index only
        if not read:
            read.append(read_user_metadata(storage, meta))
        return None if read[0] is None else dict(read[0])

    return Opened(kind, place.path, entries, ChunkFiles(storage, entries, save_id, verify=verify), user_metadata)
