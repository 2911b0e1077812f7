"""``convert(dtype=...)``: a source seen with its floating-point tensors cast to another dtype.

Only the IEEE and bfloat16 dtypes are cast (float16, bfloat16, float32, float64): integer, bool
and complex tensors keep their dtype, and so do float8 tensors, which hold quantized values
whose scales live in other entries (casting them alone would change what they mean).
Each chunk is cast as it is read, so memory stays at one chunk. A finite value outside the
target's range (float32 ``1e30`` into float16, which would become inf) raises CastError naming
the entry, as every load's cast does (``format/casts.py``), unless ``allow_cast``; the conversion
then stops before its commit and leaves nothing behind.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from ..format.casts import check_cast, range_can_shrink
from .common import Source

__all__ = ["CAST_DTYPES", "CASTABLE", "cast_dtype", "CastSource"]

#: The names ``--dtype`` accepts, and the dtype each means.
CAST_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
               "half": torch.float16, "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
               "float64": torch.float64, "fp64": torch.float64, "double": torch.float64}
#: The dtypes that are cast; every other dtype is kept.
CASTABLE = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})


def cast_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """The target dtype named by ``dtype`` (a torch dtype, or a name of :data:`CAST_DTYPES`, ``torch.`` allowed).

    Raises:
        ValueError: no floating dtype of that name.
    """
    if isinstance(dtype, torch.dtype):
        if dtype not in CASTABLE:
            raise ValueError(f"dtype must be one of float16, bfloat16, float32, float64, got {dtype}")
        return dtype
    found = CAST_DTYPES.get(str(dtype).removeprefix("torch.").lower())
    if found is None:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join(CAST_DTYPES)}")
    return found


def _cast_item(item: Any, dtype: torch.dtype) -> Any:
    if not isinstance(item, TensorStorageMetadata) or item.properties.dtype not in CASTABLE \
            or item.properties.dtype == dtype:
        return item
    old = item.properties
    props = TensorProperties(dtype=dtype, layout=old.layout, requires_grad=old.requires_grad,
                             memory_format=old.memory_format, pin_memory=old.pin_memory)
    return TensorStorageMetadata(properties=props, size=item.size, chunks=item.chunks)


class CastSource(Source):
    """``inner`` with every float16/bfloat16/float32/float64 tensor read as ``dtype`` (values outside its range
    refused unless ``allow_cast``)."""

    def __init__(self, inner: Source, dtype: torch.dtype, *, allow_cast: bool = False) -> None:
        self._inner, self.dtype, self.allow_cast = inner, dtype, allow_cast
        self.kind, self.path, self.version, self.files = inner.kind, inner.path, inner.version, inner.files
        self.side_files = inner.side_files
        self.layout = inner.layout
        md = inner.metadata
        # The storage records still name the source's bytes: the writers use them only to find chunks stored
        # once (tied weights), which cast alike, and write new records for what they write.
        self.metadata = Metadata(state_dict_metadata={k: _cast_item(v, dtype) for k, v in md.state_dict_metadata.items()},
                                 planner_data=md.planner_data, storage_data=md.storage_data, storage_meta=md.storage_meta,
                                 version=md.version)

    def read_tensor(self, idx: MetadataIndex) -> torch.Tensor:
        t = self._inner.read_tensor(idx)
        if t.dtype not in CASTABLE or t.dtype == self.dtype:
            return t
        if not self.allow_cast and range_can_shrink(t.dtype, self.dtype):
            check_cast(t, t.dtype, self.dtype, allow_cast=False, path=self.path, entry=idx.fqn,
                       fix="pass allow_cast=True (--allow-cast) to cast anyway")
        return t.to(self.dtype)

    def read_bytes(self, idx: MetadataIndex) -> bytes:
        return self._inner.read_bytes(idx)

    def bytes_length(self, idx: MetadataIndex) -> int:
        return self._inner.bytes_length(idx)

    def read_object(self, idx: MetadataIndex) -> Any:
        return self._inner.read_object(idx)

    def user_metadata(self) -> dict[str, str] | None:
        return self._inner.user_metadata()

    def close(self) -> None:
        self._inner.close()
