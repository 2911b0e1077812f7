"""What a save tells the metadata encoder, in the format's own types: DCP's ``Metadata`` without DCP.

The encoder (codec.py ``encode_metadata``, v2.py ``encode_table``) reads a checkpoint's description
through a handful of attributes, the ones DCP's ``Metadata`` has: ``version``,
``state_dict_metadata`` (``{fqn: tensor entry or payload}``), ``planner_data``, ``storage_data``
(``{index: record}``) and ``storage_meta``. ``MmapWriter`` hands it DCP's own objects; ``mmapckpt.save``
hands it these, which carry the same attributes and no more, so that a save of a flat dict of tensors
imports no ``torch.distributed`` (issue 44: the package takes 0.5-1 s to import here). A tensor entry
is told from a payload by its ``chunks``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

__all__ = ["DCP_VERSION", "Properties", "Chunk", "TensorEntry", "Index", "Record", "StorageMeta", "WrittenMetadata"]


#: The DCP metadata version the stock writer records, as MmapWriter and ``mmapckpt.save`` do.
DCP_VERSION = "1.0.0"


class Properties(NamedTuple):
    """A tensor's properties the metadata keeps: its dtype (a ``torch.dtype``) and ``requires_grad``."""

    dtype: Any
    requires_grad: bool = False


class Chunk(NamedTuple):
    """Where one stored chunk lies in its tensor."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


class TensorEntry(NamedTuple):
    """A tensor of the state dict: its properties, its whole size, its chunks."""

    properties: Properties
    size: tuple[int, ...]
    chunks: list[Chunk]


class Index(NamedTuple):
    """A storage record's key: the entry's name, the chunk's offsets (None for a payload), the chunk index hint."""

    fqn: str
    offset: tuple[int, ...] | None
    index: int | None = None


class Record(NamedTuple):
    """A chunk's bytes: the file (relative to the checkpoint), offset and length, and any stream transforms."""

    relative_path: str
    offset: int
    length: int
    transform_descriptors: list[str] | None = None


class StorageMeta(NamedTuple):
    """The save's identity: the checkpoint it was saved as, its save id, and the modules it names (none)."""

    checkpoint_id: str | None
    save_id: str | None
    modules: tuple[str, ...] = ()


class WrittenMetadata(NamedTuple):
    """A checkpoint's description, as the encoder reads it."""

    version: str
    state_dict_metadata: dict[str, TensorEntry]
    planner_data: dict[str, tuple[str, ...]] | None
    storage_data: dict[Index, Record]
    storage_meta: StorageMeta | None
