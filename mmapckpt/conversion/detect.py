"""Which format a path or URL holds (``reading/locate.py``, shared with ``mmapckpt.open``), and the conversion
source that reads it."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from ..format.metadata import KIND_MMAPCKPT
from ..reading.locate import detect_format, indexed_files, locate_checkpoint, place_format, safetensors_files
from ..dcp.metadata import read_metadata
from .common import Source
from .flat import SafetensorsSource, TorchSource
from .sources import MmapckptSource, StockSource

__all__ = ["detect_format", "open_source"]


def open_source(path: str | os.PathLike[str], *, storage_options: Mapping[str, Any] | None = None) -> Source:
    """Open the checkpoint at ``path`` (any format of FORMATS; a local path or a URL of a registered medium, whose
    storage gets ``storage_options``) for reading."""
    place = locate_checkpoint(path, storage_options=storage_options)
    kind = place_format(place)
    if kind in ("mmapckpt", "dcp"):
        storage = place.storage
        got, md = read_metadata(storage, storage.find_metadata())
        return (MmapckptSource if got == KIND_MMAPCKPT else StockSource)(place.path, md, storage)
    if kind == "safetensors":  # a file, a Hugging Face index and its shards, or a directory with model.safetensors
        return SafetensorsSource(place, safetensors_files(place))
    return TorchSource(place, indexed_files(place, "torch"))  # a file, or pytorch_model.bin (and an index)
