"""safetensors data read as DCP chunks: a Hugging Face file's tensors, or the tail of a stock SAFETENSORS shard.

Two places hold DCP tensor chunks as safetensors data:

- a safetensors file of a Hugging Face directory (downloaded from the Hub, or written by
  ``HuggingFaceStorageWriter``), read by MmapReader as torch's ``HuggingFaceStorageReader``
  reads it (dcp/safetensors_metadata.py builds the metadata);
- a stock DCP shard written with ``FileSystemWriter(serialization_format=SerializationFormat.SAFETENSORS)``:
  the rank's non-tensor items (pickled bytes) come first, then one safetensors file's bytes
  holding every tensor chunk of the shard under its fqn. The ``.metadata`` records every
  tensor item at the offset where those bytes start (with the chunk's byte length), so each
  chunk is found by name in that header. torch's own FileSystemReader cannot read these
  shards (it hands the bytes to ``torch.load``).

Either way ``__metadata__`` may hold ``DCP_SHARDING_INFO``: JSON of ``{fqn: {"saved_offsets": [...]}}``,
the chunk's offsets in the whole tensor (a file without it holds whole tensors). A chunk is
located by its name, and its dtype, shape and offsets must be the ones the metadata gives it.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from ..errors import FormatError, SizeMismatchError
from ..format.stock import raw_record
from ..storage.base import StoredFile
from .safetensors_files import SafetensorsFile, is_safetensors_file

if TYPE_CHECKING:
    import torch

__all__ = ["SHARDING_KEY", "SafetensorsChunks", "raw_record", "saved_offsets", "stock_safetensors"]

#: The ``__metadata__`` key of the chunks' offsets (torch's ``_hf_utils.CUSTOM_METADATA_KEY``).
SHARDING_KEY = "DCP_SHARDING_INFO"


def saved_offsets(metadata: dict[str, str] | None, path: str) -> dict[str, tuple[int, ...]]:
    """``{fqn: chunk offsets}`` from a header's ``__metadata__`` (empty where it has no ``DCP_SHARDING_INFO``).

    Raises:
        FormatError: ``DCP_SHARDING_INFO`` that is not ``{fqn: {"saved_offsets": [int, ...]}}``.
    """
    raw = (metadata or {}).get(SHARDING_KEY)
    if raw is None:
        return {}
    try:
        doc = json.loads(raw)
        out = {k: tuple(v["saved_offsets"]) for k, v in doc.items()}
        ok = all(type(o) is int and o >= 0 for offs in out.values() for o in offs)
    except (ValueError, TypeError, KeyError, AttributeError, RecursionError):
        ok = False
    if not ok:
        raise FormatError(f"{SHARDING_KEY} is not {{fqn: {{\"saved_offsets\": [...]}}}}", path=path, entry=SHARDING_KEY)
    return out


class SafetensorsChunks:
    """The tensor chunks of one safetensors header at byte ``base`` of an open file (not owned: never closed here).

    The file is mapped (MAP_PRIVATE) where its medium maps.
    """

    def __init__(self, f: StoredFile, base: int = 0) -> None:
        self.st = SafetensorsFile(f, base)
        self.path = f.path
        self.offsets = saved_offsets(self.st.header.metadata, self.path)

    @property
    def source(self) -> Any:
        """What a ``Moves`` of these chunks reads from: the mapping, or the file where it has none."""
        return self.st.file if self.st.file is not None else self.st.stored

    def locate(self, fqn: str, offsets: tuple[int, ...], dtype: torch.dtype, sizes: tuple[int, ...],
               label: str) -> tuple[int, int]:
        """(file offset, length) of the chunk of ``fqn`` at ``offsets``, which must have ``dtype`` and ``sizes``.

        Raises:
            FormatError: the header lacks the tensor, or holds it with another dtype or other offsets.
            SizeMismatchError: it holds it with another shape.
        """
        e = self.st.header.entries.get(fqn)
        if e is None:
            raise FormatError("the safetensors header has no tensor of this name", path=self.path, entry=label)
        if e.dtype != dtype:
            raise FormatError(f"the safetensors header holds it as {e.dtype}, the metadata says {dtype}",
                              path=self.path, entry=label)
        if tuple(e.shape) != tuple(sizes):
            raise SizeMismatchError(f"the safetensors header holds it with shape {list(e.shape)}, the metadata says "
                                    f"{list(sizes)}", path=self.path, entry=label)
        saved = self.offsets.get(fqn, (0,) * len(sizes))
        if tuple(saved) != tuple(offsets):
            raise FormatError(f"the file holds the chunk at offsets {list(saved)}, the metadata asks for "
                              f"{list(offsets)}", path=self.path, entry=label)
        return self.st.place(fqn)

    def view(self, offset: int, length: int, dtype: torch.dtype, sizes: tuple[int, ...], *,
             lazy: bool = False) -> torch.Tensor:
        """The chunk at ``offset`` (from :meth:`locate`): a view over the mapping where it is aligned, else a copy;
        without a mapping read into memory, or with ``lazy`` a placeholder for a ``Moves`` to read."""
        if lazy and self.st.file is None:
            from .fetches import placeholder

            return placeholder(offset, dtype, sizes)
        return self.st.view(offset, length, dtype, sizes)

    def aligned(self, offset: int, dtype: torch.dtype) -> bool:
        """Whether :meth:`view` at ``offset`` is a view of the mapping (or a placeholder), not a copy."""
        return self.st.file is None or not offset % dtype.itemsize


def stock_safetensors(f: StoredFile, offset: int, length: int, dtype: torch.dtype,
                      sizes: tuple[int, ...]) -> SafetensorsChunks | None:
    """The one probe of a stock DCP shard's tensors (``open``/``load``/``convert``/``inspect`` through
    reading/chunks.py, ``dcp.load`` through dcp/safetensors_reads.py): the safetensors data that starts where a
    tensor record of ``length`` bytes of ``dtype`` and ``sizes`` is placed (``offset``), or None for a
    ``torch.save`` item (a record that cannot be raw bytes is not probed: :func:`raw_record`)."""
    if raw_record(length, dtype, sizes) and is_safetensors_file(f, offset):
        return SafetensorsChunks(f, offset)
    return None
