"""The DCP metadata of a Hugging Face safetensors directory, as torch's ``HuggingFaceStorageReader`` builds it.

Such a directory has no ``.metadata``: MmapReader makes one from the safetensors headers (read
through the storage; no file is mapped), so ``dcp.load`` plans over it as over any checkpoint:

- the files: those the format table (reading/formats.py, reading/hf_dirs.py) names for the directory,
  as for every reader: those ``model.safetensors.index.json`` (or the directory's only
  ``*.safetensors.index.json``) names, else ``model.safetensors``, else every ``*.safetensors`` file of
  the directory (a PEFT adapter; what ``HuggingFaceStorageWriter(save_distributed=True)`` leaves: one
  file per rank, no index);
- one stored chunk per tensor of each file, at the offsets its ``__metadata__``'s
  ``DCP_SHARDING_INFO`` gives (whole tensors without it); a tensor's size spans its chunks;
- ``TensorProperties`` with the dtype only, as torch's reader sets them;
- per chunk a ``_StorageInfo`` (file, byte offset, length) of its bytes in the file;
- ``planner_data`` naming each tensor a flat key (torch's reader leaves it None, so that
  ``_load_state_dict_from_keys(keys=...)`` fails there).

Unlike torch's reader, which keeps the last file's chunk where two files hold the same one, a
chunk held twice, chunks of one tensor with different dtypes or ranks, and chunks that leave
part of their tensor unstored are refused (FormatError naming the file and tensor).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from ..errors import CheckpointNotFoundError, FormatError
from ..format.entries import paused_gc
from ..format.tiling import tiling_problem
from ..reading.dcp_safetensors import saved_offsets
from ..reading.located import Place
from ..reading.formats import recognise
from ..reading.opened import open_safetensors
from ..reading.safetensors_files import header_of
from ..storage.base import CheckpointStorage
from ..storage.location import is_url

__all__ = ["KIND_SAFETENSORS", "hf_metadata", "safetensors_metadata"]

#: MmapReader's metadata kind for a Hugging Face directory.
KIND_SAFETENSORS = "safetensors"


def _files(storage: CheckpointStorage, path: str) -> dict[str, list[str] | None]:
    """{file: the tensors the index puts there, or None for all}: the files the format table's record of the
    directory names (reading/hf_dirs.py: the index's, ``model.safetensors``, else every ``*.safetensors``)."""
    place = Place(path, storage, None, not is_url(path))
    fmt = recognise(place)
    if fmt.files is None or fmt.opener is not open_safetensors:  # the table's records read by the safetensors backend
        raise CheckpointNotFoundError(f"not a directory of safetensors files but a {fmt.what}", path=path)
    return fmt.files(place)[0]


def hf_metadata(storage: CheckpointStorage, path: str, rank: int | None = None) -> tuple[str, Metadata]:
    """The format table's ``dcp_metadata`` of safetensors directories: ``(KIND_SAFETENSORS, metadata)``."""
    return KIND_SAFETENSORS, safetensors_metadata(storage, path)


def safetensors_metadata(storage: CheckpointStorage, path: str) -> Metadata:
    """The DCP ``Metadata`` of the Hugging Face directory ``path`` (its ``storage``); see the module docstring.

    Raises:
        CheckpointNotFoundError: no safetensors files there.
        FormatError: a damaged header, index or ``DCP_SHARDING_INFO``, or chunks that do not make a tensor.
    """
    with paused_gc():  # thousands of small objects: see format/entries.paused_gc
        return _build(storage, path)


def _build(storage: CheckpointStorage, path: str) -> Metadata:
    sdm: dict[str, TensorStorageMetadata] = {}
    storage_data: dict[MetadataIndex, _StorageInfo] = {}
    where: dict[str, str] = {}  # tensor -> a file holding it, for messages
    for rel, names in _files(storage, path).items():
        with storage.open_file(rel) as f:
            header = header_of(f)
        full = storage.full(rel)
        offsets = saved_offsets(header.metadata, full)
        for name in header.entries if names is None else names:
            e = header.entries.get(name)
            if e is None:
                raise FormatError("the index names this tensor for this file, but its header lacks it", path=full,
                                  entry=name)
            off = offsets.get(name, (0,) * len(e.shape))
            if len(off) != len(e.shape):
                raise FormatError(f"DCP_SHARDING_INFO gives offsets {list(off)} to a tensor of shape "
                                  f"{list(e.shape)}", path=full, entry=name)
            idx = MetadataIndex(name, torch.Size(off))
            if idx in storage_data:
                raise FormatError(f"two files hold this tensor: {where[name]} and {full} (a name may be in one file "
                                  "only; remove or rename one of them)", path=full, entry=f"{name}@{list(off)}")
            storage_data[idx] = _StorageInfo(rel, header.data_start + e.begin, e.end - e.begin)
            where[name] = full
            _add_chunk(sdm, name, e.dtype, off, e.shape, full)
    for name, md in sdm.items():  # every element stored exactly once: no gap, no overlap (format/tiling.py)
        problem = tiling_problem(md.size, [(c.offsets, c.sizes) for c in md.chunks])
        if problem is not None:
            raise FormatError(f"the stored chunks of this tensor do not make up its size {list(md.size)}: {problem}",
                              path=where[name], entry=name)
    # Each name is a flat key of its own (as DCP records a flat state dict's keys), so that loads that select
    # keys through the metadata (_load_state_dict_from_keys(keys=...)) work; torch's reader leaves it None.
    return Metadata(state_dict_metadata=sdm, storage_data=storage_data,  # type: ignore[arg-type]
                    planner_data={name: (name,) for name in sdm})


def _add_chunk(sdm: dict[str, Any], name: str, dtype: torch.dtype, off: tuple[int, ...], shape: tuple[int, ...],
               path: str) -> None:
    chunk = ChunkStorageMetadata(offsets=torch.Size(off), sizes=torch.Size(shape))
    md = sdm.get(name)
    if md is None:
        sdm[name] = TensorStorageMetadata(properties=TensorProperties(dtype=dtype),
                                          size=torch.Size([o + s for o, s in zip(off, shape)]), chunks=[chunk])
        return
    if md.properties.dtype != dtype or len(md.size) != len(shape):
        raise FormatError(f"chunk of {dtype} {list(shape)} where another file holds {md.properties.dtype} "
                          f"{list(md.size)}", path=path, entry=name)
    md.chunks.append(chunk)
    md.size = torch.Size([max(a, o + s) for a, o, s in zip(md.size, off, shape)])
