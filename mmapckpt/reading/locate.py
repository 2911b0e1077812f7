"""Which checkpoint format a path holds, and its files opened for lazy reading.

One detection for every reader (``open``/``load``/``load_into``, ``convert``, ``inspect``,
``verify``):

- a directory with ``.metadata``: an mmapckpt or a stock DCP checkpoint (the metadata's
  first bytes tell which);
- a directory with ``model.safetensors.index.json`` (or exactly one ``*.safetensors.index.json``):
  a Hugging Face sharded model; its ``weight_map`` names each tensor's file;
- a directory with ``model.safetensors`` and no index: a Hugging Face model in one file
  (``config.json`` and tokenizer files beside it are ignored);
- a file that is a safetensors file (by its name or its first bytes), or a ``torch.save``
  file (a zip archive or a pickle).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from ..errors import CheckpointError, CheckpointNotFoundError, FormatError
from ..format.entries import EntryInfo
from ..format.metadata import METADATA_NAME
from ..format.safetensors import entry_infos
from ..io.files import open_inside
from ..storage.commits import read_index, read_user_metadata
from ..storage.local import LocalFile, LocalStorage
from ..storage.location import is_url, storage_for
from .backend import ChunkBackend
from .chunks import ChunkFiles
from .safetensors_files import SafetensorsFile, SafetensorsFiles, is_safetensors_file
from .torchfile import TorchFiles, is_torch_file

__all__ = [
    "FORMATS",
    "SAFETENSORS_INDEX",
    "SAFETENSORS_SINGLE",
    "Opened",
    "detect_format",
    "index_file",
    "open_backend",
    "safetensors_files",
]

FORMATS = ("mmapckpt", "dcp", "safetensors", "torch")
SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"  # the one file of an unsharded Hugging Face model directory
#: The largest safetensors index read (real ones are tens of KiB).
MAX_INDEX_SIZE = 64 << 20


def index_file(path: str) -> str | None:
    """The directory's safetensors index: model.safetensors.index.json, else the only *.safetensors.index.json."""
    if os.path.isfile(os.path.join(path, SAFETENSORS_INDEX)):
        return os.path.join(path, SAFETENSORS_INDEX)
    found = sorted(n for n in os.listdir(path) if n.endswith(".safetensors.index.json"))
    return os.path.join(path, found[0]) if len(found) == 1 else None


def _pairs_once(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        raise ValueError(f"the name {dup!r} appears twice")
    return out


def _read_index(idx_path: str) -> dict[str, str]:
    try:
        d, name = os.path.split(idx_path)
        data = LocalStorage(d).read_file(name, MAX_INDEX_SIZE)
        doc = json.loads(data.decode("utf-8"), object_pairs_hook=_pairs_once)
    except FormatError as e:
        raise FormatError(f"unreadable safetensors index: {e.args[0]}", path=idx_path) from None
    except (OSError, ValueError, RecursionError) as e:
        raise FormatError(f"unreadable safetensors index: {e}", path=idx_path) from None
    wm = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(wm, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in wm.items()):
        raise FormatError("safetensors index has no 'weight_map' of name -> file", path=idx_path)
    return wm


def _named_inside(path: str, name: str) -> str:
    """``path/name``, refused (UnsafePathError) where it resolves outside ``path`` (io/files.py open_inside:
    links into the ``blobs/`` of a Hugging Face hub cache snapshot are followed)."""
    open_inside(path, name)
    return os.path.join(path, os.path.normpath(name))


def safetensors_files(path: str) -> tuple[dict[str, list[str] | None], str | None]:
    """``({path of each file: the names the index puts there, or None for all}, the index file)``.

    A directory's index, ``model.safetensors`` and the files the index names must resolve inside
    the directory, or be links into the ``blobs/`` of the hub cache whose snapshot it is.

    Raises:
        CheckpointNotFoundError: a directory without an index or ``model.safetensors``.
        FormatError, CheckpointError: a damaged index, or a file it names that is missing or outside the directory.
    """
    if not os.path.isdir(path):
        return {path: None}, None
    idx_path = index_file(path)
    if idx_path is None:
        single = os.path.join(path, SAFETENSORS_SINGLE)
        if not os.path.isfile(single):
            raise CheckpointNotFoundError(f"no {SAFETENSORS_INDEX} or {SAFETENSORS_SINGLE} here", path=path)
        return {_named_inside(path, SAFETENSORS_SINGLE): None}, None
    files: dict[str, list[str] | None] = {}
    for name, rel in _read_index(_named_inside(path, os.path.basename(idx_path))).items():
        full = _named_inside(path, rel)
        if not os.path.isfile(full):
            raise CheckpointError("shard file named in the index is missing", path=full, entry=name)
        files.setdefault(full, []).append(name)  # type: ignore[union-attr]
    return files, idx_path


def detect_format(path: str | os.PathLike[str], *, storage_options: Mapping[str, Any] | None = None) -> str:
    """The format of the checkpoint at ``path``: one of FORMATS.

    Raises:
        CheckpointNotFoundError: nothing there, a URL, or nothing recognisable.
        IncompleteCheckpointError: DCP shards without committed metadata.
    """
    p = os.fspath(path)
    if is_url(p):  # a DCP checkpoint on another medium (storage/location.py); URLs of no medium are refused
        storage = storage_for(p, options=storage_options)
        return storage.commit_kind(storage.find_metadata())
    if os.path.isdir(p):
        storage = LocalStorage(p)
        if storage.exists(METADATA_NAME):
            return storage.commit_kind(METADATA_NAME)
        if index_file(p) is not None or os.path.isfile(os.path.join(p, SAFETENSORS_SINGLE)):
            return "safetensors"
        try:
            storage.find_metadata()  # raises IncompleteCheckpointError (shards without a commit) or:
        except CheckpointNotFoundError:
            raise CheckpointNotFoundError(f"no checkpoint here: no {METADATA_NAME} (mmapckpt or DCP), "
                                          f"{SAFETENSORS_INDEX} or {SAFETENSORS_SINGLE}", path=p) from None
    if not os.path.exists(p):
        raise CheckpointNotFoundError("no such file or directory", path=p)
    if not os.path.isfile(p):
        raise CheckpointNotFoundError("not a checkpoint file or directory", path=p)
    if p.endswith(".safetensors"):
        return "safetensors"
    with LocalFile(p) as f:
        if is_safetensors_file(f):
            return "safetensors"
    if is_torch_file(p):
        return "torch"
    raise CheckpointNotFoundError("not a recognised checkpoint (mmapckpt, DCP, safetensors or torch.save)", path=p)


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


def _open_safetensors(path: str) -> Opened:
    files, _ = safetensors_files(path)
    root = path if os.path.isdir(path) else (os.path.dirname(path) or ".")
    opened: dict[str, SafetensorsFile] = {}
    entries: dict[str, EntryInfo] = {}
    for full, names in files.items():
        rel = os.path.relpath(full, root)
        f = opened[rel] = SafetensorsFile(LocalFile(full))
        for name, info in entry_infos(f.header, rel, names).items():
            if name in entries:  # only without an index: one file's header cannot name a tensor twice
                raise FormatError("two files hold this tensor", path=full, entry=name)
            entries[name] = info
    entries = {name: entries[name] for name in sorted(entries)}  # safe_open's keys() order
    metas = [f.header.metadata for f in opened.values()]

    def user_metadata() -> dict[str, str] | None:
        if all(m is None for m in metas):
            return None
        merged: dict[str, str] = {}
        for m in reversed(metas):  # an index's shards usually carry the same dict; the first file wins
            merged.update(m or {})
        return merged

    return Opened("safetensors", root, entries, SafetensorsFiles(root, opened), user_metadata)


def open_backend(path: str, *, verify: bool = False, storage_options: Mapping[str, Any] | None = None) -> Opened:
    """Open the checkpoint at ``path`` (any of FORMATS) for lazy reading; see :class:`Opened`.

    ``verify`` turns on the CRC-32 check of mmapckpt entries; the other formats have no
    checksums (their structure is checked on open whatever ``verify`` says).
    """
    if os.path.basename(path) == METADATA_NAME and os.path.isfile(path):  # the commit file: its directory
        path = os.path.dirname(path) or "."
    kind = detect_format(path, storage_options=storage_options)
    if kind == "safetensors":
        return _open_safetensors(path)
    if kind == "torch":
        files, entries = TorchFiles.open(path)
        return Opened(kind, os.path.dirname(path) or ".", entries, files, _no_metadata)
    storage = storage_for(path, options=storage_options)
    meta = storage.find_metadata()
    kind, entries, save_id = read_index(storage, meta)
    read: list[dict[str, str] | None] = []

    def user_metadata() -> dict[str, str] | None:  # read on first use: open() itself decodes the index only
        if not read:
            read.append(read_user_metadata(storage, meta))
        return None if read[0] is None else dict(read[0])

    return Opened(kind, path, entries, ChunkFiles(storage, entries, save_id, verify=verify), user_metadata)
