"""Sources for flat files: a safetensors file (or HF-sharded directory) and a torch.save state dict (or a Hugging
Face directory of them).

The bytes are read by the format wing (``format/safetensors.py`` parses and checks the
header, ``reading/torchfile.py`` loads with ``weights_only=True``), the same readers
``mmapckpt.open`` uses. They present the metadata ``dcp.save`` would write for the same state dict on one
rank (one chunk per tensor, one file ``__0_0.distcp``), so every writer treats them
like a DCP checkpoint.
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

from ..format.safetensors import entry_infos
from ..reading.located import Place
from ..reading.safetensors_files import SafetensorsFile
from ..reading.torchfile import flat_torch_files, is_zip
from .common import SINGLE_FILE, Source

__all__ = ["SafetensorsSource", "TorchSource"]


def _flat_metadata(specs: dict[str, tuple[torch.dtype, tuple[int, ...]] | None],
                   planner_data: dict[str, tuple[Any, ...]]) -> tuple[Metadata, list[MetadataIndex]]:
    """The metadata ``dcp.save`` writes for a flat state dict on one rank."""
    sdm: dict[str, Any] = {}
    order = []
    for name, spec in specs.items():
        if spec is None:
            sdm[name] = BytesStorageMetadata()
            order.append(MetadataIndex(name))
            continue
        dtype, shape = spec
        zeros = torch.Size([0] * len(shape))
        sdm[name] = TensorStorageMetadata(properties=TensorProperties(dtype=dtype), size=torch.Size(shape),
                                          chunks=[ChunkStorageMetadata(offsets=zeros, sizes=torch.Size(shape))])
        order.append(MetadataIndex(name, zeros, 0))
    md = Metadata(state_dict_metadata=sdm, planner_data=planner_data, storage_data=None,
                  storage_meta=StorageMeta(save_id=str(uuid.uuid4())), version="1.0.0")
    return md, order


class SafetensorsSource(Source):
    def __init__(self, place: Place, found: tuple[dict[str, list[str] | None], str | None]) -> None:
        """``found``: ``reading/locate.py`` ``safetensors_files(place)``: each file's name and the tensors the
        index puts there (None: all), and the index's name (None: no index)."""
        files, index = found
        self.path, self.kind = place.path, "safetensors"
        self._handles: dict[str, SafetensorsFile] = {}
        self._where: dict[str, Any] = {}
        specs: dict[str, Any] = {}
        for rel, names in files.items():
            full = place.full(rel)
            h = self._handles[full] = SafetensorsFile(place.open(rel))  # the header checked: FormatError naming
            for name, info in entry_infos(h.header, full, names or None).items():  # file and entry
                specs[name] = (info.dtype, info.shape)
                self._where[name] = (h, info)
        self.metadata, order = _flat_metadata(specs, {k: (k,) for k in specs})
        self.layout = [(SINGLE_FILE, order)]
        self.files = len(files)
        self.version = "single file" if not place.is_dir else \
            "model.safetensors in a directory" if index is None else f"{len(files)} shards with index"

    def read_tensor(self, idx: MetadataIndex) -> torch.Tensor:
        h, info = self._where[idx.fqn]
        c = info.chunks[0]
        return h.view(c.file_offset, c.length, info.dtype, c.sizes)

    def user_metadata(self) -> dict[str, str] | None:
        """The files' ``__metadata__``, merged: an index's shards carry the same one (the first file wins)."""
        merged: dict[str, str] = {}
        for h in reversed(list(self._handles.values())):
            merged.update(h.header.metadata or {})
        return merged or None

    def close(self) -> None:
        handles, self._handles = self._handles, {}
        for h in handles.values():
            h.close()  # views already read keep their mappings
        self._where.clear()


class TorchSource(Source):
    def __init__(self, place: Place, found: tuple[dict[str, list[str] | None], str | None] | None = None) -> None:
        """The file at ``place``, or ``found`` (``reading/locate.py`` ``indexed_files(place, "torch")``: a
        directory's files and index); a local file is mapped by torch.load, one at a URL read whole into memory."""
        files, index = ({place.name or "": None}, None) if found is None else found
        self.path, self.kind, self.files = place.path, "torch", len(files)
        flat, mapping = flat_torch_files(place, files)
        self._values = flat
        specs = {k: (v.dtype, tuple(v.shape)) if isinstance(v, torch.Tensor) else None for k, v in flat.items()}
        self.metadata, order = _flat_metadata(specs, mapping)
        self.layout = [(SINGLE_FILE, order)]
        with place.open(next(iter(files))) as f:
            kind = "torch.save zip archive" if is_zip(f) else "torch.save legacy format"
        self.version = kind if not place.is_dir else \
            f"{kind}: pytorch_model.bin in a directory" if index is None else f"{kind}: {len(files)} shards with index"

    def read_tensor(self, idx: MetadataIndex) -> torch.Tensor:
        return self._values[idx.fqn]

    def read_bytes(self, idx: MetadataIndex) -> bytes:
        buf = io.BytesIO()
        torch.save(self._values[idx.fqn], buf)
        return buf.getvalue()

    def read_object(self, idx: MetadataIndex) -> Any:
        return self._values[idx.fqn]

    def close(self) -> None:
        self._values = {}

