"""The conversion source of DCP checkpoint directories (mmapckpt and stock): a view over the chunk backend
``mmapckpt.open`` reads them through (reading/chunks.py ``ChunkFiles``: the same file opening, save-id check and
errors as ``open``/``load``), with the directory's DCP metadata, which the sinks copy.

The commit file is read once: the index the backend reads by, the DCP ``Metadata`` and the user metadata are all
decoded from the same bytes. Chunks are read with verification (a conversion must not carry damaged bytes into a
format without checksums). Items stored through DCP stream transforms (``_extensions=``: ZStandard) are decoded here,
from the files the backend opened.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex

from ..errors import FormatError
from ..format import layout as fmt
from ..format.entries import ChunkInfo, EntryInfo
from ..format.metadata import KIND_MMAPCKPT
from ..format.stock import load_tensor
from ..format.transforms import StreamTransforms
from ..reading.chunks import ChunkFiles
from ..reading.located import Place
from ..reading.opened import open_dcp
from ..reading.shard import decode_entry
from ..dcp.metadata import decode_metadata_file
from .common import Source, label

__all__ = ["DcpSource"]


class DcpSource(Source):
    """An mmapckpt or stock DCP directory, read one chunk at a time through ``ChunkFiles``."""

    def __init__(self, place: Place) -> None:
        storage = place.storage
        commit = storage.read_commit()
        self.metadata = md = decode_metadata_file(commit.kind, commit.data, commit.full)
        if md.storage_data is None:
            raise FormatError("metadata has no storage data", path=commit.full)
        self._opened = open_dcp(place, None, True, commit)
        self._files: ChunkFiles = self._opened.files  # type: ignore[assignment]
        self.path, self.kind = place.path, commit.kind
        per_file: dict[str, list[MetadataIndex]] = {}
        for idx, info in sorted(md.storage_data.items(), key=lambda kv: (kv[1].relative_path, kv[1].offset)):
            per_file.setdefault(info.relative_path, []).append(idx)
        self.layout = list(per_file.items())
        self.files = len(self.layout)
        self.version = f"DCP metadata {md.version}"
        first = self._files.shards.get(self.layout[0][0]) if self.layout else None
        if first is not None:
            self.version = f"shard format {fmt.FORMAT_MAJOR}.{first.header.minor}, {self.version}"
        if self.kind != KIND_MMAPCKPT:
            self.version += ", torch.save items"
        self._transforms = StreamTransforms()  # DCP's registry: undoes ZStandard

    def _where(self, idx: MetadataIndex) -> tuple[Any, EntryInfo, ChunkInfo]:
        """The storage record of ``idx``, its entry and its chunk in the backend's index."""
        info = self.metadata.storage_data.get(idx)
        e = self._opened.entries.get(idx.fqn)
        want = None if idx.offset is None else tuple(idx.offset)
        c = None if e is None else e.chunks[0] if want is None else next(
            (c for c in e.chunks if c.offsets == want), None)
        if info is None or c is None:
            raise FormatError("storage record names a chunk the metadata does not list", path=self.path,
                              entry=label(idx))
        return info, e, c  # type: ignore[return-value]

    def read_tensor(self, idx: MetadataIndex) -> torch.Tensor:
        info, e, c = self._where(idx)
        if getattr(info, "transform_descriptors", None):
            t = self._decoded(idx, info, c)
            if not isinstance(t, torch.Tensor) or t.dtype != e.dtype or tuple(t.shape) != c.sizes:
                raise FormatError(f"decoded chunk is not the {e.dtype} {list(c.sizes)} the metadata says",
                                  path=self._files.storage.full(c.file), entry=label(idx))
            return t
        return self._files.chunk(e, c)

    def read_bytes(self, idx: MetadataIndex) -> bytes:
        info, e, c = self._where(idx)
        if getattr(info, "transform_descriptors", None):
            return self._decoded(idx, info, c)  # type: ignore[return-value]
        return self._files.object_bytes(e)

    def bytes_length(self, idx: MetadataIndex) -> int:
        return self._where(idx)[0].length  # type: ignore[no-any-return]

    def _decoded(self, idx: MetadataIndex, info: Any, c: ChunkInfo) -> torch.Tensor | bytes:
        """An item stored through stream transforms, decoded into memory (mmapckpt: its checksum checked)."""
        shard = self._files.shards.get(c.file)
        if shard is not None:
            e = shard.entry(idx.fqn, None if idx.offset is None else tuple(idx.offset))
            if (info.offset, info.length) != (e.offset, e.length):
                raise FormatError(f"metadata says bytes [{info.offset}, +{info.length}) but the shard header says "
                                  f"[{e.offset}, +{e.length})", path=shard.path, entry=e.label)
            shard.verify(e)
            return decode_entry(shard, e, self._transforms)
        f = self._files.stock[c.file]
        stored = f.read(info.offset, info.length, entry=label(idx))
        data = self._transforms.decode(stored, info.transform_descriptors, path=f.path, entry=label(idx))
        return data if idx.offset is None else load_tensor(data, path=f.path, entry=label(idx))  # type: ignore

    def user_metadata(self) -> dict[str, str] | None:
        return self._opened.user_metadata()

    def close(self) -> None:
        self._files.close()
