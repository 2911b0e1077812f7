"""Sources for flat files: a safetensors file (or HF-sharded directory) and a torch.save state dict.

They present the metadata ``dcp.save`` would write for the same state dict on one
rank (one chunk per tensor, one file ``__0_0.distcp``), so every writer treats them
like a DCP checkpoint.
"""

from __future__ import annotations

import io
import os
import uuid
import warnings
import zipfile
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
from .common import SAFETENSORS_DTYPES, SINGLE_FILE, Source

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
    def __init__(self, path: str, files: dict[str, list[str]]) -> None:
        from safetensors import safe_open

        self.path, self.kind = path, "safetensors"
        self._handles, self._where = {}, {}
        specs: dict[str, Any] = {}
        for full, names in files.items():
            try:
                h = safe_open(full, framework="pt", device="cpu")
            except Exception as e:
                raise FormatError(f"not a readable safetensors file: {e}", path=full) from None
            self._handles[full] = h
            for name in names if names else list(h.keys()):
                sl = h.get_slice(name)
                code = sl.get_dtype()
                if code not in SAFETENSORS_DTYPES:
                    raise FormatError(f"safetensors dtype {code!r} is not supported", path=full, entry=name)
                specs[name] = (SAFETENSORS_DTYPES[code], tuple(sl.get_shape()))
                self._where[name] = full
        self.metadata, order = _flat_metadata(specs, {k: (k,) for k in specs})
        self.layout = [(SINGLE_FILE, order)]
        self.files = len(files)
        one = list(files) == [os.path.join(path, "model.safetensors")]  # a directory without an index
        self.version = "single file" if not os.path.isdir(path) else \
            "model.safetensors in a directory" if one else f"{len(files)} shards with index"

    def read_tensor(self, idx: MetadataIndex) -> torch.Tensor:
        return self._handles[self._where[idx.fqn]].get_tensor(idx.fqn)

    def close(self) -> None:
        self._handles.clear()


class TorchSource(Source):
    def __init__(self, path: str) -> None:
        from torch.distributed.checkpoint._nested_dict import flatten_state_dict

        self.path, self.kind, self.files = path, "torch", 1
        obj = _torch_load(path)
        if not isinstance(obj, dict):
            raise FormatError(f"torch.save file holds a {type(obj).__name__}, not a state dict", path=path)
        flat, mapping = flatten_state_dict(obj)
        self._values = flat
        specs = {k: (v.dtype, tuple(v.shape)) if isinstance(v, torch.Tensor) else None for k, v in flat.items()}
        self.metadata, order = _flat_metadata(specs, mapping)
        self.layout = [(SINGLE_FILE, order)]
        self.version = "torch.save zip archive" if zipfile.is_zipfile(path) else "torch.save legacy format"

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


def _torch_load(path: str) -> Any:
    try:
        try:
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as e:
            if "mmap" not in str(e):
                raise
            warnings.warn(f"{path}: legacy torch.save format cannot be memory-mapped; loading it whole",
                          stacklevel=3)
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise FormatError(f"not loadable with torch.load(weights_only=True): {type(e).__name__}: {e}",
                          path=path) from None
