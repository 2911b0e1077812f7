"""``torch.save`` files read safely: ``torch.load(weights_only=True)``, flattened to DCP's names.

``weights_only=True`` admits only tensors, primitive containers and the few classes
torch allows, so a hostile pickle cannot run code. A local file is loaded with
``mmap=True``: torch maps the archive, so the tensors are views over torch's own (private)
mapping of the file and nothing is read until used; a legacy (pre-1.6, non-zip) file cannot
be mapped and is loaded whole, with a warning. A file on a medium without ranged access for
torch (a URL: reading/located.py) is read whole into memory (as many bytes as the file holds,
through ``StoredFile.read_into``) and loaded from there, with the same ``weights_only=True``:
the format has no index of ranges to read tensors by. Nested state dicts are flattened as
``dcp.save`` names them (``{"model": {"w": t}}`` -> ``"model.w"``), the names ``inspect`` and
``convert`` show. A Hugging Face directory of such files (``pytorch_model.bin``, or shards and
``pytorch_model.bin.index.json``: reading/locate.py ``indexed_files``) is every file loaded so,
merged into one state dict.
"""

from __future__ import annotations

import io
import warnings
import zipfile
from typing import TYPE_CHECKING, Any, Union

from ..errors import CheckpointError, FormatError
from ..format.dtypes import any_dtype_name
from ..format.entries import ChunkInfo, EntryInfo
from ..storage.base import StoredFile
from ..storage.local import LocalFile
from .located import Place

if TYPE_CHECKING:
    import torch  # imported where a file is loaded: recognising one reads 2 bytes

__all__ = ["MemoryFile", "StoredReader", "TorchFiles", "flat_torch_file", "flat_torch_files", "is_torch_file",
           "is_zip", "load_torch_file", "torch_source"]

#: What a torch.save file is loaded from: a local path (mapped), or its bytes read into memory.
TorchSource = Union[str, "MemoryFile"]


class _Window(io.RawIOBase):
    """A read-only, seekable file of ``length`` bytes; subclasses read them (:meth:`_fill`)."""

    length = 0
    pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.length}[whence]
        self.pos = max(0, base + pos)
        return self.pos

    def readinto(self, buf: Any) -> int:
        mv = memoryview(buf).cast("B")
        n = max(0, min(len(mv), self.length - self.pos))
        if n:
            self._fill(self.pos, mv[:n])
        self.pos += n
        return n

    def _fill(self, pos: int, mv: memoryview) -> None:
        raise NotImplementedError


class StoredReader(_Window):
    """A read-only, seekable window [offset, offset + length) of a stored file (all of it by default), read
    through ``read_into``, for ``torch.load`` and ``zipfile``."""

    def __init__(self, file: StoredFile, offset: int = 0, length: int | None = None) -> None:
        self.file, self.base = file, offset
        self.length = file.size - offset if length is None else length

    def _fill(self, pos: int, mv: memoryview) -> None:
        self.file.read_into(self.base + pos, mv)


class MemoryFile(_Window):
    """A torch.save file's bytes, read whole through the storage, as a seekable file (no copy of them);
    ``path`` names it in messages."""

    def __init__(self, data: Any, path: str) -> None:
        self.data, self.path = memoryview(data).cast("B"), path
        self.length = len(self.data)

    def _fill(self, pos: int, mv: memoryview) -> None:
        mv[:] = self.data[pos:pos + len(mv)]


def torch_source(place: Place, rel: str | None = None) -> TorchSource:
    """What to load the torch.save file at ``place`` (or file ``rel`` of that directory, a name checked by
    ``place.inside``) from: its local path, else its bytes read into memory."""
    if place.local:
        return place.full(rel)
    with place.open(rel) as f:
        return MemoryFile(f.read(0, f.size), f.path)


def _path(src: TorchSource) -> str:
    return src if isinstance(src, str) else src.path


def is_zip(src: TorchSource | StoredFile) -> bool:
    """Whether the torch.save file is a zip archive (the format since torch 1.6); a stored file is read only
    where a zip archive's end would be."""
    if isinstance(src, str):
        return zipfile.is_zipfile(src)
    if isinstance(src, StoredFile):
        return zipfile.is_zipfile(StoredReader(src))
    src.seek(0)
    return zipfile.is_zipfile(src)


def is_torch_file(file: StoredFile | str) -> bool:
    """Whether the file looks like a ``torch.save`` file: a zip archive or a pickle (reads 2 bytes, and a zip
    archive's end)."""
    f = LocalFile(file) if isinstance(file, str) else file
    try:
        head = bytes(f.read(0, min(2, f.size)))
        return head[:1] == b"\x80" or zipfile.is_zipfile(StoredReader(f))
    finally:
        if isinstance(file, str):
            f.close()


def load_torch_file(src: TorchSource | Place) -> Any:
    """The object a torch.save file holds, loaded with ``weights_only=True`` (mapped where the format and the
    medium allow).

    Raises:
        FormatError: not loadable that way (not a torch.save file, or one holding classes
            ``weights_only`` refuses).
    """
    import torch

    if isinstance(src, Place):
        src = torch_source(src)
    path = _path(src)
    try:
        if not isinstance(src, str):
            src.seek(0)
            return torch.load(src, map_location="cpu", weights_only=True)
        try:
            return torch.load(src, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as e:
            if "mmap" not in str(e):
                raise
            warnings.warn(f"{path}: legacy torch.save format cannot be memory-mapped; loading it whole",
                          stacklevel=3)
            return torch.load(src, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - whatever torch.load raises on a hostile file is a format error
        raise FormatError(f"not loadable with torch.load(weights_only=True): {type(e).__name__}: {e}",
                          path=path) from None


def flat_torch_files(place: Place, files: dict[str, list[str] | None]) -> tuple[dict[str, Any], dict[str, Any]]:
    """:func:`flat_torch_file` of each of ``files`` (reading/locate.py ``indexed_files``: each file's name in
    ``place``'s directory, and the names the index puts there or None for all), merged in the index's order;
    what a file holds that the index puts elsewhere, or nowhere, is left out (as of a safetensors shard).

    Raises:
        FormatError: a file does not hold a state dict, or lacks a name the index puts there.
    """
    values: dict[str, Any] = {}
    mapping: dict[str, Any] = {}
    for rel, names in files.items():
        src = torch_source(place, rel)
        flat, nesting = flat_torch_file(src)
        for name in flat if names is None else names:
            if name not in flat:
                raise FormatError("the index names this tensor for this file, but the file lacks it",
                                  path=_path(src), entry=name)
            values[name], mapping[name] = flat[name], nesting[name]
    return values, mapping


def flat_torch_file(src: TorchSource | Place) -> tuple[dict[str, Any], dict[str, Any]]:
    """The file's state dict flattened as ``dcp.save`` names it, and DCP's mapping back to the nesting.

    Raises:
        FormatError: the file does not hold a dict.
    """
    import torch

    if isinstance(src, Place):
        src = torch_source(src)
    obj = load_torch_file(src)
    if not isinstance(obj, dict):
        raise FormatError(f"torch.save file holds a {type(obj).__name__}, not a state dict", path=_path(src))
    if all(type(k) is str and isinstance(v, torch.Tensor) for k, v in obj.items()):
        # a flat dict of tensors (pytorch_model.bin): DCP's flattening keeps every name and value as they
        # are; saying so here spares a single-process load importing torch.distributed.checkpoint
        return dict(obj), {k: (k,) for k in obj}
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict  # nested: DCP's walk is the rule

    return flatten_state_dict(obj)


class TorchFiles:
    """The chunk backend of ``mmapckpt.open`` for a torch.save file: every value loaded (lazily mapped) on open.

    Tensors are returned as torch.load built them (views over torch's mapping of a local file,
    or tensors in memory for a file read whole, with the strides and storage sharing they were
    saved with); non-tensor values were unpickled with ``weights_only=True`` and need no
    ``allow_unpickle``. No checksums.
    """

    pickled_objects = False

    def __init__(self, path: str, values: dict[str, Any], nesting: dict[str, Any] | None = None) -> None:
        self.path, self.values = path, values
        #: DCP's mapping of each flat name back to the state dict's nesting (planner_data)
        self.nesting = nesting if nesting is not None else {k: (k,) for k in values}

    @classmethod
    def open(cls, place: Place, files: dict[str, list[str] | None] | None = None
             ) -> tuple[TorchFiles, dict[str, EntryInfo]]:
        """Load the file at ``place``, or ``files`` of its directory (see :func:`flat_torch_files`); return the
        backend and its index (one whole-tensor chunk per tensor)."""
        import torch

        if files is None:
            files = {place.name or "": None}
        flat, nesting = flat_torch_files(place, files)
        where = {name: rel for rel, names in files.items() for name in (flat if names is None else names)}
        path = place.path
        values: dict[str, Any] = {}
        entries: dict[str, EntryInfo] = {}
        for i, (name, v) in enumerate(flat.items()):
            rel = where[name]
            if isinstance(v, torch.Tensor):
                t = v if type(v) is torch.Tensor else v.detach()  # a Parameter comes back as a plain tensor
                if t.device.type != "cpu":  # map_location="cpu" makes this unreachable; never hand out others
                    raise FormatError(f"tensor was loaded on {t.device}", path=place.full(rel), entry=name)
                shape = tuple(t.shape)
                # no file position: torch places the bytes (a distinct negative offset keeps entries apart)
                c = ChunkInfo((0,) * len(shape), shape, rel, -1 - i, t.numel() * t.element_size())
                entries[name] = EntryInfo(name, "tensor", any_dtype_name(t.dtype), shape, (c,))
                values[name] = t
            else:
                entries[name] = EntryInfo(name, "object", None, None, (ChunkInfo((), (), rel, 0, 0),))
                values[name] = v
        return cls(path, values, nesting), entries

    def chunk(self, info: EntryInfo, c: ChunkInfo, *, lazy: bool = False) -> torch.Tensor:
        return self.values[info.name]  # in memory already (``mapped`` is None: never a placeholder)

    def region(self, info: EntryInfo, c: ChunkInfo, index: tuple[slice, ...]) -> torch.Tensor:
        return self.values[info.name][index]

    def mapped(self, info: EntryInfo, c: ChunkInfo) -> None:
        return None  # torch owns the mapping: its tensors are copied from, never read around

    def advise(self, c: ChunkInfo, advice: int, *, sequential: bool = False) -> None:
        pass

    def check_unchanged(self, chunks: Any) -> None:
        pass

    def object_value(self, info: EntryInfo) -> Any:
        if info.name not in self.values:
            raise CheckpointError("no such entry", path=self.path, entry=info.name)
        return self.values[info.name]

    def object_bytes(self, info: EntryInfo) -> bytes:
        raise CheckpointError("a torch.save file's values are loaded, not stored as bytes: use object_value",
                              path=self.path, entry=info.name)

    def close(self) -> None:
        self.values = {}
