"""Which format a path holds (``reading/locate.py``, shared with ``mmapckpt.open``), and the conversion source
that reads it."""

from __future__ import annotations

import os

from ..format.metadata import KIND_MMAPCKPT, METADATA_NAME
from ..reading.locate import detect_format, safetensors_files
from ..storage.commits import read_metadata
from ..storage.location import storage_for
from .common import Source
from .flat import SafetensorsSource, TorchSource
from .sources import MmapckptSource, StockSource

__all__ = ["detect_format", "open_source"]


def open_source(path: str | os.PathLike[str]) -> Source:
    """Open the checkpoint at ``path`` (any format of FORMATS) for reading."""
    p = os.fspath(path)
    if os.path.basename(p) == METADATA_NAME and os.path.isfile(p):
        p = os.path.dirname(p) or "."
    kind = detect_format(p)
    if kind in ("mmapckpt", "dcp"):
        storage = storage_for(p)
        got, md = read_metadata(storage, storage.find_metadata())
        return MmapckptSource(p, md) if got == KIND_MMAPCKPT else StockSource(p, md)
    if kind == "safetensors":  # a file, a Hugging Face index and its shards, or a directory with model.safetensors
        return SafetensorsSource(p, safetensors_files(p)[0])
    return TorchSource(p)
