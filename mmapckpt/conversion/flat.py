"""The conversion source of flat files (a safetensors file or directory, a torch.save file or Hugging Face
directory of them): a view over the chunk backend ``mmapckpt.open`` reads them through.

The format table (reading/formats.py) opens the checkpoint (reading/opened.py: the same backend,
the same checks and errors as ``open``/``load``); this view presents the metadata ``dcp.save``
would write for the same state dict on one rank (one chunk per stored chunk, one file
``__0_0.distcp``), so every writer treats it like a DCP checkpoint.
"""

from __future__ import annotations

import io
import uuid
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from ..errors import FormatError
from ..format.entries import EntryInfo
from ..reading.formats import Format
from ..reading.opened import Opened
from .common import SINGLE_FILE, Source, label

__all__ = ["BackendSource"]


def _metadata(entries: dict[str, EntryInfo], planner_data: dict[str, Any]) -> tuple[Metadata, list[MetadataIndex]]:
    """The metadata ``dcp.save`` writes for these entries on one rank."""
    sdm: dict[str, Any] = {}
    order = []
    for name, e in entries.items():
        if e.kind != "tensor":
            sdm[name] = BytesStorageMetadata()
            order.append(MetadataIndex(name))
            continue
        chunks = [ChunkStorageMetadata(offsets=torch.Size(c.offsets), sizes=torch.Size(c.sizes)) for c in e.chunks]
        sdm[name] = TensorStorageMetadata(properties=TensorProperties(dtype=e.dtype), size=torch.Size(e.shape),
                                          chunks=chunks)
        order += [MetadataIndex(name, torch.Size(c.offsets), i) for i, c in enumerate(e.chunks)]
    md = Metadata(state_dict_metadata=sdm, planner_data=planner_data, storage_data=None,
                  storage_meta=StorageMeta(save_id=str(uuid.uuid4())), version="1.0.0")
    return md, order


class BackendSource(Source):
    """A checkpoint opened by the format table, read one chunk at a time through its backend."""

    def __init__(self, opened: Opened, fmt: Format, index: str | None = None) -> None:
        """``opened``: ``fmt.open(place)``; ``index``: the name of the directory's index, if it has one."""
        assert opened.place is not None
        self._opened, self._entries = opened, opened.entries
        self.path, self.kind = opened.place.path, opened.kind
        self.files = len(opened.layout or ())
        nesting = getattr(opened.files, "nesting", None)
        self.metadata, order = _metadata(opened.entries, nesting or {k: (k,) for k in opened.entries})
        self.layout = [(SINGLE_FILE, order)]
        assert fmt.version is not None, fmt.name
        self.version = fmt.version(opened, index)
        self.side_files = fmt.owns != () and opened.place.is_dir  # a Hugging Face directory of the table

    def _entry(self, idx: MetadataIndex) -> EntryInfo:
        e = self._entries.get(idx.fqn)
        if e is None:
            raise FormatError("no such entry", path=self.path, entry=label(idx))
        return e

    def read_tensor(self, idx: MetadataIndex) -> torch.Tensor:
        e = self._entry(idx)
        want = tuple(idx.offset or ())
        c = next((c for c in e.chunks if c.offsets == want), None)
        if c is None:
            raise FormatError("no stored chunk at these offsets", path=self.path, entry=label(idx))
        return self._opened.files.chunk(e, c)

    def read_object(self, idx: MetadataIndex) -> Any:
        return self._opened.files.object_value(self._entry(idx))

    def read_bytes(self, idx: MetadataIndex) -> bytes:
        buf = io.BytesIO()
        torch.save(self.read_object(idx), buf)
        return buf.getvalue()

    def user_metadata(self) -> dict[str, str] | None:
        return self._opened.user_metadata()

    def close(self) -> None:
        self._opened.files.close()
