"""What a checkpoint holds under each name, and where its bytes are: the index every reader builds.

Both kinds of metadata (mmapckpt's JSON and stock DCP's pickle) are decoded into
these records, so the lazy loader, the converter and the inspector work on one shape.
They are named tuples: a checkpoint of 100,000 tensors builds 200,000 of them on open,
under :func:`paused_gc`.
"""

from __future__ import annotations

import gc
import os
import re
from contextlib import contextmanager
from typing import Any, Iterator, Mapping, Optional

from ..errors import UnsafePathError
from ..records import Record
from .dtypes import _TORCH, ITEMSIZES, torch_dtype

__all__ = ["ChunkInfo", "EntryInfo", "numel", "paused_gc", "safe_relative_path", "SaveId", "REFERENCE",
           "reference_parts", "ROOT_MARKER"]


class ChunkInfo(Record):
    """One stored chunk of a tensor: its place in the global tensor and in its file.

    Attributes:
        offsets: where the chunk starts in the global tensor, per dimension.
        sizes: the chunk's shape.
        file: the file holding it, relative to the checkpoint directory.
        file_offset: where its bytes start in that file (negative in a torch.save file).
        length: its length in bytes.
    """

    __slots__ = ()

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str  # relative to the checkpoint directory
    file_offset: int  # negative, and unique per tensor, in a torch.save file (torch owns its layout)
    length: int

    def __new__(cls, offsets: tuple[int, ...], sizes: tuple[int, ...], file: str, file_offset: int,
                length: int) -> ChunkInfo:
        return tuple.__new__(cls, (offsets, sizes, file, file_offset, length))


class EntryInfo(Record):
    """What a checkpoint holds under one name.

    ``kind`` is ``"tensor"`` or ``"object"`` (a pickled non-tensor value); ``dtype``
    and ``shape`` are None for objects. ``chunks`` lists where the bytes are.

    Attributes:
        name: the entry's name (its DCP fully-qualified name).
        kind: ``"tensor"`` or ``"object"``.
        dtype_name: the tensor's dtype by name (format/dtypes.py: the format's names, or torch's for dtypes it has
            none for); None for an object. The index is built from names, so that reading it (``inspect``)
            needs no torch; :attr:`dtype` is the torch dtype.
        shape: the global tensor's shape (None for an object).
        chunks: the stored chunks, with their files and offsets.
    """

    __slots__ = ()

    name: str
    kind: str
    dtype_name: Optional[str]
    shape: Optional[tuple[int, ...]]
    chunks: tuple[ChunkInfo, ...]

    def __new__(cls, name: str, kind: str, dtype_name: Optional[str], shape: Optional[tuple[int, ...]],
                chunks: tuple[ChunkInfo, ...]) -> EntryInfo:
        return tuple.__new__(cls, (name, kind, dtype_name, shape, chunks))

    @property
    def dtype(self) -> Any:
        """The tensor's ``torch.dtype`` (None for an object); imports torch on first use."""
        n = self.dtype_name
        if n is None:
            return None
        dt = _TORCH.get(n)  # the common case without a call (per tensor on every load path)
        return dt if dt is not None else torch_dtype(n)

    @property
    def whole(self) -> Optional[ChunkInfo]:
        """The one chunk, when a single chunk holds the whole tensor (it can then be viewed as it is)."""
        return self.chunks[0] if len(self.chunks) == 1 and self.chunks[0].sizes == self.shape else None

    @property
    def nbytes(self) -> int:
        if self.kind == "object":
            return sum(c.length for c in self.chunks)
        size = ITEMSIZES.get(self.dtype_name)  # type: ignore[arg-type]
        return numel(self.shape or ()) * (size if size is not None else self.dtype.itemsize)


def numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


@contextmanager
def paused_gc() -> Iterator[None]:
    """Hold off the cyclic garbage collector while many small objects are built.

    Decoding a metadata document allocates hundreds of thousands of containers, each
    allocation counting towards a collection that walks the whole (acyclic) document:
    for 3,000 tensors that was 80% of the time to open a checkpoint. Reference
    counting still frees everything; only the cycle search waits until the end. The
    switch is process-wide (other threads' cycles wait too, for milliseconds), and the
    collector is turned back on only if it was on, so a caller's own gc.disable() holds.
    """
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


#: The file that makes a directory (or prefix) a managed root: its steps may refer to each other's shards.
ROOT_MARKER = ".mmapckpt-root"
#: A cross-step reference (docs/format.md 3.4): one ``..``, a sibling step directory, one shard file name. The
#: pattern's text: ``re`` compiles it on first use (a managed root's load), not every new process at import.
REFERENCE = r"\.\./(step-(?:0|[1-9][0-9]{0,18}))/([^/\\\x00]+)"


def reference_parts(rel: str) -> tuple[str, str] | None:
    """(sibling step directory, file name) of a cross-step reference ``../step-{M}/{name}``; None for any other
    name (which :func:`safe_relative_path` judges)."""
    m = re.fullmatch(REFERENCE, rel)
    if m is None or m.group(2) in (".", ".."):
        return None
    return m.group(1), m.group(2)


class SaveId(str):
    """A save id that also carries the save ids of the sibling steps' shard files its records refer to
    (``references``: ``{"../step-M/name": save id}``, docs/format.md 3.4). It is the metadata's
    ``storage_meta.save_id`` wherever that travels, so every reader finds a referenced file's save id
    where it finds its own."""

    references: Mapping[str, str]

    def __new__(cls, value: str, references: Mapping[str, str]) -> "SaveId":
        self = super().__new__(cls, value)
        self.references = dict(references)
        return self

    def __reduce__(self) -> tuple[Any, ...]:  # DCP broadcasts the metadata to every rank as a pickle
        return (SaveId, (str(self), dict(self.references)))

    def of(self, rel: str) -> str | None:
        """The save id file ``rel`` must carry: a referenced file's own, else this one."""
        return self.references.get(rel) if rel.startswith("../") else str(self)


def safe_relative_path(rel: str, where: str, references: Mapping[str, str] | None = None) -> str:
    """A storage path as the metadata gives it, refused (UnsafePathError) where it could leave the checkpoint:
    empty, absolute, with a NUL, ``..`` or an empty part; except a cross-step reference ``../step-M/name``
    listed in the metadata's ``references`` (whose readers check the root and the file's save id)."""
    if references and rel in references and reference_parts(rel) is not None:
        return rel
    bad = (not rel or "\x00" in rel or os.path.isabs(rel) or rel.startswith(("/", "\\"))
           or any(part in ("..", "") for part in rel.replace("\\", "/").split("/")))
    if bad:
        raise UnsafePathError(f"storage path {rel!r} leaves the checkpoint directory", path=where)
    return rel
