"""What every conversion source and sink shares: the formats, the dtype table, the Source interface.

Every source, whatever its format, answers the same questions: its DCP ``Metadata``
(state_dict_metadata and planner_data; storage_data for DCP checkpoints), its file
layout (which items live in which file, in file order) and the bytes of one item at
a time. Non-DCP files (safetensors, torch.save) get the metadata ``dcp.save`` would
have written for them on one rank: one chunk per tensor, one file ``__0_0.distcp``.
Items are read one at a time, so a conversion never holds more than one of them.
"""

from __future__ import annotations

import io
from typing import Any, Iterator

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata

__all__ = ["FORMATS", "SAFETENSORS_DTYPES", "SAFETENSORS_INDEX", "SAFETENSORS_SINGLE", "SINGLE_FILE", "Source", "label",
           "tensor_chunk_sizes"]

FORMATS = ("mmapckpt", "dcp", "safetensors", "torch")
SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"  # the one file of an unsharded Hugging Face model directory
SINGLE_FILE = "__0_0.distcp"

#: safetensors dtype codes <-> torch dtypes, written out by hand (the safetensors spec's names).
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U64": torch.uint64, "U32": torch.uint32, "U16": torch.uint16, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "C64": torch.complex64,
}


def label(idx: MetadataIndex) -> str:
    return idx.fqn if idx.offset is None else f"{idx.fqn}@{list(idx.offset)}"


def tensor_chunk_sizes(md: Metadata) -> dict[tuple[str, tuple[int, ...]], tuple[int, ...]]:
    """(fqn, chunk offsets) -> chunk sizes, for every chunk the metadata lists."""
    return {(fqn, tuple(c.offsets)): tuple(c.sizes)
            for fqn, item in md.state_dict_metadata.items() if isinstance(item, TensorStorageMetadata)
            for c in item.chunks}


class Source:
    """A checkpoint opened for reading, one item at a time.

    Attributes:
        kind: one of FORMATS.
        path: what was opened.
        version: a human-readable description of the format version.
        metadata: DCP metadata; ``storage_data`` is None for non-DCP sources.
        layout: ``[(relative file name, [MetadataIndex, ...]), ...]`` in file order.
        files: number of files the checkpoint's data lives in.
    """

    kind: str
    path: str
    version: str
    metadata: Metadata
    layout: list[tuple[str, list[MetadataIndex]]]
    files: int

    def read_tensor(self, idx: MetadataIndex) -> torch.Tensor:
        """The stored chunk named by ``idx``, of its dtype and chunk shape."""
        raise NotImplementedError

    def read_bytes(self, idx: MetadataIndex) -> bytes:
        """A non-tensor entry as DCP stores it: ``torch.save`` bytes of the object."""
        raise NotImplementedError

    def bytes_length(self, idx: MetadataIndex) -> int:
        return len(self.read_bytes(idx))

    def read_object(self, idx: MetadataIndex) -> Any:
        """A non-tensor entry as an object, unpickled with ``weights_only=True`` (never arbitrary code)."""
        return torch.load(io.BytesIO(self.read_bytes(idx)), weights_only=True)

    def items(self) -> Iterator[tuple[str, Any]]:
        return iter(self.metadata.state_dict_metadata.items())

    def close(self) -> None:
        pass

    def __enter__(self) -> "Source":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
