"""Items of stock DCP shards: ``torch.save`` bytes at (file, offset, length), or raw tensor bytes inside the
safetensors data of a SAFETENSORS-format shard (:func:`raw_record`).

The one place that turns such an item's bytes (read through the storage, within its file's bounds) into a
tensor with ``torch.load(weights_only=True)``; the reader, the lazy loader and the
converter all go through it.
"""

from __future__ import annotations

import io
from typing import IO, TYPE_CHECKING

from ..errors import FormatError
from .entries import numel

if TYPE_CHECKING:
    import torch

__all__ = ["load_tensor", "raw_record"]


def raw_record(length: int, dtype: torch.dtype, sizes: tuple[int, ...]) -> bool:
    """Whether a stock tensor record of ``length`` bytes may point at safetensors data: a SAFETENSORS-format
    record (``FileSystemWriter(serialization_format=SAFETENSORS)``) is exactly its chunk's bytes, found by
    name in the safetensors data its record starts at (reading/dcp_safetensors.py), while a torch.save
    item is always longer (its zip framing). So a torch.save item's bytes are never probed for a header."""
    return length == dtype.itemsize * numel(sizes)


def load_tensor(src: bytes | bytearray | IO[bytes], *, path: str, entry: str) -> torch.Tensor:
    """Unpickle an item with ``weights_only=True``; anything but a tensor is a FormatError."""
    import torch  # only where a stock item is read

    try:
        t = torch.load(io.BytesIO(src) if isinstance(src, (bytes, bytearray)) else src,
                       map_location="cpu", weights_only=True)
    except Exception as e:  # malformed zip/pickle, or a global weights_only refuses
        raise FormatError(f"stock item could not be loaded: {type(e).__name__}: {e}", path=path, entry=entry) from None
    if not isinstance(t, torch.Tensor):
        raise FormatError(f"stock item holds {type(t).__name__}, not a tensor", path=path, entry=entry)
    return t
