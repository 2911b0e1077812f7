"""safetensors files opened for reading through the storage: the header read and checked, tensors as views.

The header is parsed by ``format/safetensors.py``, the one parser of it in the package. A
tensor is a view over the file mapping when its file offset is a multiple of its element
size (what ``save_file`` writes); otherwise its bytes are copied into a new, aligned tensor,
because torch cannot view misaligned elements. On a medium without mappings (an object store) a
tensor is read into a new tensor through ``StoredFile.read_into``, and a slice of one reads only
the byte ranges it needs (reading/regions.py ``read_region``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..errors import CheckpointError, FormatError, TruncatedFileError
from ..format.entries import ChunkInfo, EntryInfo
from ..format.safetensors import MAX_HEADER_SIZE, SafetensorsHeader, looks_like_safetensors, parse_header
from ..io.mapped import MappedFile
from ..storage.base import StoredFile
from ..storage.local import LocalFile

if TYPE_CHECKING:  # torch, and the modules that read without a mapping, are imported where a tensor is made:
    import torch   # opening a file reads only its header (inspect imports no torch)

__all__ = ["SafetensorsFile", "SafetensorsFiles", "header_of", "read_header", "is_safetensors_file"]


def header_of(f: StoredFile, base: int = 0) -> SafetensorsHeader:
    """Read and check the safetensors header at byte ``base`` of ``f`` (0: a safetensors file; more: the
    safetensors data a stock DCP shard ends with). The data runs to the end of the file; the
    header's ``data_start`` and ``file_size`` are relative to ``base``."""
    size, path = f.size - base, f.path
    if size < 8:
        raise TruncatedFileError(f"a {size}-byte file cannot hold a safetensors header (8-byte length first)",
                                 path=path)
    n = int.from_bytes(f.read(base, 8), "little")
    if n > MAX_HEADER_SIZE:
        raise FormatError(f"header length {n} exceeds the limit of {MAX_HEADER_SIZE} bytes (not a safetensors "
                          "file, or a damaged one)", path=path)
    if 8 + n > size:
        raise TruncatedFileError(f"header length {n} runs past the end of the {size}-byte file", path=path)
    return parse_header(bytes(f.read(base + 8, n)), size, path)



def read_header(path: str) -> SafetensorsHeader:
    """Read and check the header of the local safetensors file at ``path`` (no data read)."""
    with LocalFile(path) as f:
        return header_of(f)


def is_safetensors_file(f: StoredFile, base: int = 0) -> bool:
    """Whether the file starts (at byte ``base``) like a safetensors file (a plausible length, then ``{``);
    reads 9 bytes."""
    return f.size - base >= 9 and looks_like_safetensors(bytes(f.read(base, 9)), f.size - base)


class SafetensorsFile:
    """A safetensors file opened for reading: its checked header, and the file mapped (MAP_PRIVATE) where the
    medium maps.

    The header is read from the file that is then mapped, so a file renamed over the path in
    between cannot pair this header with other bytes.
    """

    def __init__(self, file: StoredFile | str, base: int = 0) -> None:
        self.stored = file if isinstance(file, StoredFile) else LocalFile(file)
        #: where the safetensors data starts in the file (0 but in a stock DCP shard: see header_of)
        self.base = base
        try:
            self.header = header_of(self.stored, base)
        except BaseException:
            self.stored.close()
            raise
        self.path = self.stored.path
        #: the mapping (None where the medium has none: tensors are then read)
        self.file: MappedFile | None = self.stored.mapping

    def place(self, name: str) -> tuple[int, int]:
        """(file offset, length) of tensor ``name``'s bytes.

        Raises:
            FormatError: the header has no such tensor.
        """
        e = self.header.entries.get(name)
        if e is None:
            raise FormatError("the safetensors header has no such tensor", path=self.path, entry=name)
        return self.base + self.header.data_start + e.begin, e.end - e.begin

    def view(self, offset: int, length: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """The tensor whose ``length`` bytes start at file ``offset`` (checked when the header was parsed):
        a view over the mapping when ``offset`` is a multiple of the element size, else an aligned copy."""
        if self.file is None:
            import torch

            out = torch.empty(shape, dtype=dtype)
            if length:
                self.stored.read_into(offset, out.reshape(-1).view(torch.uint8).numpy())
            return out
        if not offset % dtype.itemsize:
            return self.file.view(offset, dtype, shape)
        return self.file.raw(offset, length).clone().view(dtype).view(shape)

    def region(self, offset: int, length: int, dtype: torch.dtype, shape: tuple[int, ...],
               index: tuple[slice, ...]) -> torch.Tensor:
        """``view(...)[index]``: over the mapping where there is one, else only the bytes ``index`` needs, read."""
        if self.file is None:
            from .regions import read_region

            return read_region(self.stored, offset, dtype, shape, index)
        return self.view(offset, length, dtype, shape)[index]

    def close(self) -> None:
        self.stored.close()


class SafetensorsFiles:
    """The chunk backend of ``mmapckpt.open`` for safetensors files: one chunk per tensor, at a file offset.

    ``files`` maps each file's name relative to ``root`` to its opened :class:`SafetensorsFile`.
    There are no checksums in the format, so ``verify`` checks nothing more than opening did.
    """

    pickled_objects = False

    def __init__(self, root: str, files: dict[str, SafetensorsFile]) -> None:
        self.root, self.files = root, files

    def chunk(self, info: EntryInfo, c: ChunkInfo, *, lazy: bool = False) -> torch.Tensor:
        f = self.files[c.file]
        if lazy and f.file is None:  # its bounds were checked when the header was parsed
            from .fetches import placeholder

            return placeholder(c.file_offset, info.dtype, c.sizes)  # type: ignore[arg-type]
        return f.view(c.file_offset, c.length, info.dtype, c.sizes)  # type: ignore[arg-type]

    def region(self, info: EntryInfo, c: ChunkInfo, index: tuple[slice, ...]) -> torch.Tensor:
        return self.files[c.file].region(c.file_offset, c.length, info.dtype, c.sizes, index)  # type: ignore[arg-type]

    def mapped(self, info: EntryInfo, c: ChunkInfo) -> MappedFile | StoredFile | None:
        """The mapping ``chunk`` returns a view of (for direct reads), the file where it has no mapping (its
        bytes are read wherever they lie), or None where ``chunk`` returns a copy (a misaligned tensor)."""
        f = self.files[c.file]
        if f.file is None:
            return f.stored
        return f.file if not c.file_offset % info.dtype.itemsize else None  # type: ignore[union-attr]

    def advise(self, c: ChunkInfo, advice: int, *, sequential: bool = False) -> None:
        f = self.files[c.file].file
        if f is not None:
            f.advise(advice, c.file_offset, c.length, sequential=sequential)

    def check_unchanged(self, chunks: Any) -> None:
        for rel in {c.file for c in chunks}:
            self.files[rel].stored.check_unchanged()

    def object_value(self, info: EntryInfo) -> Any:
        raise CheckpointError("safetensors files hold tensors only", path=self.root, entry=info.name)

    def object_bytes(self, info: EntryInfo) -> bytes:
        raise CheckpointError("safetensors files hold tensors only", path=self.root, entry=info.name)

    def close(self) -> None:
        for f in self.files.values():
            f.close()
