"""The chunk backend: what the lazy loader (``open``, ``load``, ``load_into``) asks of an opened checkpoint.

One implementation per format: ``chunks.ChunkFiles`` (mmapckpt and stock DCP directories),
``safetensors_files.SafetensorsFiles`` and ``torchfile.TorchFiles``. The loaders differ between
formats only through these methods.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

import torch

from ..format.entries import ChunkInfo, EntryInfo
from ..io.mapped import MappedFile
from ..storage.base import StoredFile

__all__ = ["ChunkBackend"]


class ChunkBackend(Protocol):
    """An opened checkpoint's chunks.

    Attributes:
        pickled_objects: whether non-tensor entries are pickles (:meth:`object_bytes`, which only the
            caller's consent may unpickle) rather than values loaded safely (:meth:`object_value`).
    """

    pickled_objects: bool

    def chunk(self, info: EntryInfo, c: ChunkInfo, *, lazy: bool = False) -> torch.Tensor:
        """Chunk ``c`` of ``info`` as a CPU tensor: a view over a mapping where it can be, else a new tensor.
        ``lazy``, where :meth:`mapped` gave a file without a mapping: a placeholder for a ``Moves`` of that
        file to read (reading/fetches.py)."""
        ...

    def region(self, info: EntryInfo, c: ChunkInfo, index: tuple[slice, ...]) -> torch.Tensor:
        """``chunk(info, c)[index]`` (one slice per dimension): a view where the chunk is one, else a new tensor
        read from no more of the file than the selection needs (reading/regions.py ``read_region``) where the
        medium has no mapping."""
        ...

    def mapped(self, info: EntryInfo, c: ChunkInfo) -> MappedFile | StoredFile | None:
        """What :meth:`chunk`'s bytes are read from by a ``Moves`` (reading/moves.py): the mapping it returns
        a view of (direct reads go around it), the file where it has no mapping, or None (a copy in memory)."""
        ...

    def advise(self, c: ChunkInfo, advice: int, *, sequential: bool = False) -> None:
        """Pass a madvise hint for the chunk's pages (nothing where there is no mapping); ``sequential``: advise
        its file to be read in order first (io/mapped.py)."""
        ...

    def check_unchanged(self, chunks: Iterable[ChunkInfo]) -> None:
        """Raise TruncatedFileError if a file holding one of ``chunks`` shrank since it was opened."""
        ...

    def object_value(self, info: EntryInfo) -> Any:
        """A non-tensor entry's value, where the format stores values safely (``pickled_objects`` False)."""
        ...

    def object_bytes(self, info: EntryInfo) -> bytes:
        """A non-tensor entry's stored bytes (a pickle, where ``pickled_objects``)."""
        ...

    def close(self) -> None:
        """Release the files (views already returned keep their mappings)."""
        ...
