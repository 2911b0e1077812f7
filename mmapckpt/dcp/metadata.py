"""A commit's DCP ``Metadata``: read through a storage, decoded by the format wing, built here.

The format wing (``format/metadata/``) decodes a ``.metadata`` file into its own index and
builds no DCP object, so that ``open``/``load``/``load_into`` need no ``torch.distributed``.
``dcp.load`` plans with DCP's ``Metadata``: :func:`read_metadata` (what ``MmapReader``,
``convert``'s detection and ``verify`` call) reads the commit through the storage and builds
it from the index (records.py), at once or on demand (``lazy``). A stock DCP ``.metadata`` is
a pickle of DCP's classes: its checked, unpickled ``Metadata`` is returned as it is
(``format/metadata/stock.py``).
"""

from __future__ import annotations

import os

from torch.distributed.checkpoint.metadata import Metadata

from ..format.metadata import KIND_MMAPCKPT, METADATA_NAME, decode_built
from ..format.metadata.stock import decode_stock
from ..storage.base import CheckpointStorage
from ..storage.location import storage_for
from .records import lazy_dcp, to_dcp

__all__ = ["decode_metadata", "decode_metadata_lazy", "decode_metadata_file", "read_metadata", "read_metadata_file"]


def decode_metadata(data: bytes, path: str) -> Metadata:
    """Decode an mmapckpt ``.metadata`` file's bytes into DCP ``Metadata``; every defect raises FormatError."""
    return decode_built(data, path, to_dcp)


def decode_metadata_lazy(data: bytes, path: str) -> Metadata:
    """As :func:`decode_metadata`, with the entries' records built on demand (records.py)."""
    return decode_built(data, path, lazy_dcp)


def decode_metadata_file(kind: str, data: bytes, path: str, *, lazy: bool = False) -> Metadata:
    """A ``.metadata`` file's bytes of either kind (``framing.metadata_kind``) as DCP Metadata.

    ``lazy``: an mmapckpt file's ``state_dict_metadata`` and ``storage_data`` are read-only
    mappings whose records are built on first access (records.py); every entry is
    checked before this returns either way.
    """
    if kind != KIND_MMAPCKPT:
        return decode_stock(data, path)
    return decode_metadata_lazy(data, path) if lazy else decode_metadata(data, path)


def read_metadata(storage: CheckpointStorage, name: str = METADATA_NAME, *, lazy: bool = False) -> tuple[str, Metadata]:
    """(kind, DCP Metadata) of commit file ``name`` at ``storage`` (see :func:`decode_metadata_file`)."""
    f = storage.read_metadata(name)
    return f.kind, decode_metadata_file(f.kind, f.data, f.full, lazy=lazy)


def read_metadata_file(path: str | os.PathLike[str], *, lazy: bool = False) -> tuple[str, Metadata]:
    """:func:`read_metadata` of a local commit file's path."""
    d, name = os.path.split(os.fspath(path))
    return read_metadata(storage_for(d or "."), name, lazy=lazy)
