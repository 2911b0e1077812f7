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

from typing import Any

from ...records import Record as NamedRecord  # this module's Record is DCP's storage record

__all__ = ["DCP_VERSION", "Properties", "Chunk", "TensorEntry", "Index", "Record", "StorageMeta", "WrittenMetadata"]


#: The DCP metadata version the stock writer records, as MmapWriter and ``mmapckpt.save`` do.
DCP_VERSION = "1.0.0"


class Properties(NamedRecord):
    """A tensor's properties the metadata keeps: its dtype (a ``torch.dtype``) and ``requires_grad``."""

    __slots__ = ()

    dtype: Any
    requires_grad: bool

    def __new__(cls, dtype: Any, requires_grad: bool = False) -> Properties:
        return tuple.__new__(cls, (dtype, requires_grad))


class Chunk(NamedRecord):
    """Where one stored chunk lies in its tensor."""

    __slots__ = ()

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    def __new__(cls, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> Chunk:
        return tuple.__new__(cls, (offsets, sizes))


class TensorEntry(NamedRecord):
    """A tensor of the state dict: its properties, its whole size, its chunks."""

    __slots__ = ()

    properties: Properties
    size: tuple[int, ...]
    chunks: list[Chunk]

    def __new__(cls, properties: Properties, size: tuple[int, ...], chunks: list[Chunk]) -> TensorEntry:
        return tuple.__new__(cls, (properties, size, chunks))


class Index(NamedRecord):
    """A storage record's key: the entry's name, the chunk's offsets (None for a payload), the chunk index hint."""

    __slots__ = ()

    fqn: str
    offset: tuple[int, ...] | None
    index: int | None

    def __new__(cls, fqn: str, offset: tuple[int, ...] | None, index: int | None = None) -> Index:
        return tuple.__new__(cls, (fqn, offset, index))


class Record(NamedRecord):
    """A chunk's bytes: the file (relative to the checkpoint), offset and length, and any stream transforms."""

    __slots__ = ()

    relative_path: str
    offset: int
    length: int
    transform_descriptors: list[str] | None

    def __new__(cls, relative_path: str, offset: int, length: int,
                transform_descriptors: list[str] | None = None) -> Record:
        return tuple.__new__(cls, (relative_path, offset, length, transform_descriptors))


class StorageMeta(NamedRecord):
    """The save's identity: the checkpoint it was saved as, its save id, and the modules it names (none)."""

    __slots__ = ()

    checkpoint_id: str | None
    save_id: str | None
    modules: tuple[str, ...]

    def __new__(cls, checkpoint_id: str | None, save_id: str | None, modules: tuple[str, ...] = ()) -> StorageMeta:
        return tuple.__new__(cls, (checkpoint_id, save_id, modules))


class WrittenMetadata(NamedRecord):
    """A checkpoint's description, as the encoder reads it."""

    __slots__ = ()

    version: str
    state_dict_metadata: dict[str, TensorEntry]
    planner_data: dict[str, tuple[str, ...]] | None
    storage_data: dict[Index, Record]
    storage_meta: StorageMeta | None

    def __new__(cls, version: str, state_dict_metadata: dict[str, TensorEntry],
                planner_data: dict[str, tuple[str, ...]] | None, storage_data: dict[Index, Record],
                storage_meta: StorageMeta | None) -> WrittenMetadata:
        return tuple.__new__(cls, (version, state_dict_metadata, planner_data, storage_data, storage_meta))
