"""A checkpoint opened for lazy reading: its entry index and the chunk backend every reader reads it through.

One opener per kind of backend, named by the format table (reading/formats.py): DCP directories
(mmapckpt and stock: ``ChunkFiles``), safetensors files and directories (``SafetensorsFiles``),
``torch.save`` files and directories of them (``TorchFiles``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from ..errors import FormatError
from ..format.entries import EntryInfo
from ..format.metadata import KIND_MMAPCKPT, decode_index_file, decode_user_metadata
from ..format.tiling import tiling_problem
from ..records import Record
from ..storage.base import CommitFile
from .hf_dirs import Files
from .located import Place

if TYPE_CHECKING:  # each backend is imported by its opener: the index of a DCP directory or of safetensors files
    # is read without torch (inspect), and a load of one format imports no other format's backend
    from ..format.safetensors import SafetensorsHeader
    from .backend import ChunkBackend

__all__ = ["Opened", "open_dcp", "open_safetensors", "open_torch", "safetensors_union"]


class Opened(Record):
    """A checkpoint opened for lazy reading.

    Attributes:
        kind: one of FORMATS (reading/formats.py): the format's family.
        root: the directory that chunk file names are relative to.
        entries: the index, by name, in the checkpoint's order.
        files: the chunk backend (``ChunkFiles``, ``SafetensorsFiles`` or ``TorchFiles``: reading/backend.py).
        user_metadata: returns the ``{str: str}`` user metadata, or None where there is none.
        place: where it was opened.
        layout: the files read, by name relative to ``root`` (``None`` for a DCP directory: its metadata names them).
        save_id: the commit's save id (DCP directories; None elsewhere).
    """

    __slots__ = ()

    kind: str
    root: str
    entries: dict[str, EntryInfo]
    files: ChunkBackend
    user_metadata: Callable[[], dict[str, str] | None]
    place: Place | None
    layout: tuple[str, ...] | None
    save_id: str | None

    def __new__(cls, kind: str, root: str, entries: dict[str, EntryInfo], files: ChunkBackend,
                user_metadata: Callable[[], dict[str, str] | None], place: Place | None = None,
                layout: tuple[str, ...] | None = None, save_id: str | None = None) -> Opened:
        return tuple.__new__(cls, (kind, root, entries, files, user_metadata, place, layout, save_id))


def _no_metadata() -> None:
    return None


def open_dcp(place: Place, files: Files | None, verify: bool, commit: CommitFile | None = None, *,
             index: tuple[Mapping[str, EntryInfo], str | None] | None = None) -> Opened:
    """An mmapckpt or stock DCP directory: its committed index, read through ``ChunkFiles``. ``commit``: the commit
    file, where the caller has read it (``convert`` decodes DCP's metadata from the same bytes); ``index``: its
    (entries, save id), where the caller has decoded them (``inspect``: with the version)."""
    storage = place.storage
    if commit is None:
        commit = storage.read_commit()
    entries, save_id = decode_index_file(commit.kind, commit.data, commit.full) if index is None else index
    read: list[dict[str, str] | None] = []

    def user_metadata() -> dict[str, str] | None:  # decoded on first use: open() itself decodes the index only
        if not read:
            read.append(decode_user_metadata(commit.kind, commit.data, commit.full))
        return None if read[0] is None else dict(read[0])

    from .chunks import ChunkFiles

    backend = ChunkFiles(storage, entries, save_id, verify=verify, stock=commit.kind != KIND_MMAPCKPT)
    return Opened(commit.kind, place.path, entries, backend, user_metadata, place, None, save_id)


def safetensors_union(place: Place, parts: list[tuple[str, SafetensorsHeader, list[str] | None]]
                      ) -> dict[str, EntryInfo]:
    """The entries of safetensors files read together (``parts``: each file's name, header, and the names an
    index puts there or None for all): one whole-tensor chunk per tensor, or the chunks ``DCP_SHARDING_INFO``
    places, which must tile their tensor.

    Raises:
        FormatError: a name in two files that are not distinct chunks of one tensor (naming both files), chunks
            of one tensor that disagree in dtype or rank or leave part of it unstored, a damaged header entry.
    """
    from ..format.safetensors import entry_infos
    from .dcp_safetensors import saved_offsets

    entries: dict[str, EntryInfo] = {}
    where: dict[str, str] = {}
    for rel, header, names in parts:
        full = place.full(rel)
        offsets = saved_offsets(header.metadata, full)
        for name, info in entry_infos(header, rel, names).items():
            c = info.chunks[0]
            off = offsets.get(name)
            if off is not None:
                if len(off) != len(c.sizes):
                    raise FormatError(f"DCP_SHARDING_INFO gives offsets {list(off)} to a tensor of shape "
                                      f"{list(c.sizes)}", path=full, entry=name)
                c = c._replace(offsets=tuple(off))
            prev = entries.get(name)
            if prev is None:
                entries[name] = info._replace(chunks=(c,), shape=tuple(o + s for o, s in zip(c.offsets, c.sizes)))
                where[name] = full
                continue
            if any(p.offsets == c.offsets for p in prev.chunks):
                raise FormatError(f"two files hold this tensor: {where[name]} and {full} (a name may be in one "
                                  "file only; remove or rename one of them)", path=full, entry=name)
            if prev.dtype_name != info.dtype_name or len(prev.shape or ()) != len(c.sizes):
                raise FormatError(f"chunk of {info.dtype} {list(c.sizes)} where {where[name]} holds {prev.dtype} "
                                  f"{list(prev.shape or ())}", path=full, entry=name)
            shape = tuple(max(a, o + s) for a, o, s in zip(prev.shape or (), c.offsets, c.sizes))
            entries[name] = prev._replace(chunks=prev.chunks + (c,), shape=shape)
    for name, e in entries.items():
        if len(e.chunks) > 1 or any(e.chunks[0].offsets):
            problem = tiling_problem(e.shape or (), [(c.offsets, c.sizes) for c in e.chunks])
            if problem is not None:
                raise FormatError(f"the stored chunks of this tensor do not make up its size {list(e.shape or ())}: "
                                  f"{problem}", path=where[name], entry=name)
    return {name: entries[name] for name in sorted(entries)}  # safe_open's keys() order


def open_safetensors(place: Place, files: Files, verify: bool) -> Opened:
    """safetensors files (one file, an index's shards, or a directory's files read as their union)."""
    from .safetensors_files import SafetensorsFile, SafetensorsFiles

    opened: dict[str, SafetensorsFile] = {}
    try:
        for rel in files:
            opened[rel] = SafetensorsFile(place.open(rel))
        entries = safetensors_union(place, [(rel, f.header, files[rel]) for rel, f in opened.items()])
    except BaseException:
        for f in opened.values():
            f.close()
        raise
    metas = [f.header.metadata for f in opened.values()]

    def user_metadata() -> dict[str, str] | None:
        if all(m is None for m in metas):
            return None
        merged: dict[str, str] = {}
        for m in reversed(metas):  # an index's shards usually carry the same dict; the first file wins
            merged.update(m or {})
        return merged

    return Opened("safetensors", place.root, entries, SafetensorsFiles(place.root, opened), user_metadata, place,
                  tuple(files))


def open_torch(place: Place, files: Files, verify: bool) -> Opened:
    """``torch.save`` files (one file, or a Hugging Face directory of them), loaded with ``weights_only=True``."""
    from .torchfile import TorchFiles

    backend, entries = TorchFiles.open(place, files)
    return Opened("torch", place.root, entries, backend, _no_metadata, place, tuple(files))

