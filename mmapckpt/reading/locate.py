"""Which checkpoint a path or URL names, and that checkpoint opened for lazy reading, as the format table
(reading/formats.py) recognises and opens it.

One detection for every reader (``open``/``load``/``load_into``/``load_model``, ``MmapReader``,
``convert``, ``inspect``, ``verify``), on a local path or a URL of any registered medium
(reading/located.py: a URL names a directory where files exist under it, else a file). The
formats and the rule for each layout are the table's (docs/lazy.md, "Formats"); every file is read
through the storage (``storage/base.py``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from ..format.metadata import METADATA_NAME
from .formats import FORMATS, Format, recognise, resolve
from .hf_dirs import SAFETENSORS_INDEX, SAFETENSORS_SINGLE, TORCH_INDEX, TORCH_SINGLE, index_name, indexed_files
from .located import Place, locate
from .opened import Opened

__all__ = ["FORMATS", "SAFETENSORS_INDEX", "SAFETENSORS_SINGLE", "TORCH_INDEX", "TORCH_SINGLE", "Opened",
           "detect_format", "find_checkpoint", "index_name", "indexed_files", "locate_checkpoint", "open_backend",
           "place_format"]


def locate_checkpoint(path: str | os.PathLike[str], *,
                      storage_options: Mapping[str, Any] | None = None) -> Place:
    """Where ``path`` (a path or URL) names a checkpoint: :func:`located.locate`, with a ``.metadata`` file
    taken as its directory and a place that leads to another (a hub cache repository) resolved."""
    place = locate(path, options=storage_options)
    if place.name == METADATA_NAME:  # the commit file: its directory
        return place.directory()
    return resolve(place)


def find_checkpoint(path: str | os.PathLike[str], *,
                    storage_options: Mapping[str, Any] | None = None) -> tuple[Place, Format]:
    """The place ``path`` names and its format's record."""
    place = locate_checkpoint(path, storage_options=storage_options)
    return place, recognise(place)


def place_format(place: Place) -> str:
    """The format family of the checkpoint at ``place``: one of FORMATS (see :func:`detect_format`)."""
    return recognise(place).family


def detect_format(path: str | os.PathLike[str], *, storage_options: Mapping[str, Any] | None = None) -> str:
    """The format of the checkpoint at ``path`` (a local path, or a URL of a registered medium): one of FORMATS.

    ``storage_options`` go to the medium of a URL (``storage/location.py`` ``storage_for``).

    Raises:
        CheckpointNotFoundError: nothing there, a URL of no registered medium, or nothing recognisable.
        IncompleteCheckpointError: DCP shards without committed metadata.
    """
    return place_format(resolve(locate(path, options=storage_options)))


def open_backend(path: str | os.PathLike[str], *, verify: bool = False,
                 storage_options: Mapping[str, Any] | None = None) -> Opened:
    """Open the checkpoint at ``path`` (any of FORMATS; a local path or a URL) for lazy reading; see :class:`Opened`.

    ``verify`` turns on the CRC-32 check of mmapckpt entries; the other formats have no
    checksums (their structure is checked on open whatever ``verify`` says). ``storage_options``
    go to the medium of a URL (``storage/location.py`` ``storage_for``).
    """
    place, fmt = find_checkpoint(path, storage_options=storage_options)
    return fmt.open(place, verify=verify)
