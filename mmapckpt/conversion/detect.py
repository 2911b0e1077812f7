"""Which format a path or URL holds (the format table, reading/formats.py, shared with ``mmapckpt.open``), and
the conversion source that reads it: for flat files a view over the backend ``open`` reads them through."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from ..reading.locate import detect_format, find_checkpoint
from .common import Source
from .flat import BackendSource
from .sources import DcpSource

__all__ = ["detect_format", "open_source"]


def open_source(path: str | os.PathLike[str], *, storage_options: Mapping[str, Any] | None = None) -> Source:
    """Open the checkpoint at ``path`` (any format of FORMATS; a local path or a URL of a registered medium, whose
    storage gets ``storage_options``) for reading."""
    place, fmt = find_checkpoint(path, storage_options=storage_options)
    if fmt.files is None:  # a DCP directory: its metadata names the files
        return DcpSource(place)
    files, index = fmt.files(place)  # the index read once: for the files to open and for the version
    return BackendSource(fmt.opener(place, files, False), fmt, index)  # type: ignore[misc]
