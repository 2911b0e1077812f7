"""``torch.save`` files read safely: ``torch.load(weights_only=True, mmap=True)``, flattened to DCP's names.

``weights_only=True`` admits only tensors, primitive containers and the few classes
torch allows, so a hostile pickle cannot run code; ``mmap=True`` maps the archive, so
the tensors are views over torch's own (private) mapping of the file and nothing is read
until used. A legacy (pre-1.6, non-zip) file cannot be mapped and is loaded whole, with
a warning. Nested state dicts are flattened as ``dcp.save`` names them
(``{"model": {"w": t}}`` -> ``"model.w"``), the names ``inspect`` and ``convert`` show.
"""

from __future__ import annotations

import os
import warnings
import zipfile
from typing import Any

import torch

from ..errors import CheckpointError, FormatError
from ..format.entries import ChunkInfo, EntryInfo

__all__ = ["TorchFiles", "flat_torch_file", "is_torch_file", "load_torch_file"]


def is_torch_file(path: str) -> bool:
    """Whether the file looks like a ``torch.save`` file: a zip archive or a pickle (reads 2 bytes)."""
    with open(path, "rb") as f:
        head = f.read(2)
    return head[:1] == b"\x80" or zipfile.is_zipfile(path)


def load_torch_file(path: str) -> Any:
    """The object a torch.save file holds, loaded with ``weights_only=True`` (mapped where the format allows).

    Raises:
        FormatError: not loadable that way (not a torch.save file, or one holding classes
            ``weights_only`` refuses).
    """
    try:
        try:
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as e:
            if "mmap" not in str(e):
                raise
            warnings.warn(f"{path}: legacy torch.save format cannot be memory-mapped; loading it whole",
                          stacklevel=3)
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - whatever torch.load raises on a hostile file is a format error
        raise FormatError(f"not loadable with torch.load(weights_only=True): {type(e).__name__}: {e}",
                          path=path) from None


def flat_torch_file(path: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The file's state dict flattened as ``dcp.save`` names it, and DCP's mapping back to the nesting.

    Raises:
        FormatError: the file does not hold a dict.
    """
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    obj = load_torch_file(path)
    if not isinstance(obj, dict):
        raise FormatError(f"torch.save file holds a {type(obj).__name__}, not a state dict", path=path)
    return flatten_state_dict(obj)


class TorchFiles:
    """The chunk backend of ``mmapckpt.open`` for a torch.save file: every value loaded (lazily mapped) on open.

    Tensors are returned as torch.load built them (views over torch's mapping of the file,
    with the strides and storage sharing they were saved with); non-tensor values were
    unpickled with ``weights_only=True`` and need no ``allow_unpickle``. No checksums.
    """

    pickled_objects = False

    def __init__(self, path: str, values: dict[str, Any]) -> None:
        self.path, self.values = path, values

    @classmethod
    def open(cls, path: str) -> tuple[TorchFiles, dict[str, EntryInfo]]:
        """Load the file; return the backend and its index (one whole-tensor chunk per tensor)."""
        flat, _ = flat_torch_file(path)
        rel = os.path.basename(path)
        values: dict[str, Any] = {}
        entries: dict[str, EntryInfo] = {}
        for i, (name, v) in enumerate(flat.items()):
            if isinstance(v, torch.Tensor):
                t = v if type(v) is torch.Tensor else v.detach()  # a Parameter comes back as a plain tensor
                if t.device.type != "cpu":  # map_location="cpu" makes this unreachable; never hand out others
                    raise FormatError(f"tensor was loaded on {t.device}", path=path, entry=name)
                shape = tuple(t.shape)
                # no file position: torch places the bytes (a distinct negative offset keeps entries apart)
                c = ChunkInfo((0,) * len(shape), shape, rel, -1 - i, t.numel() * t.element_size())
                entries[name] = EntryInfo(name, "tensor", t.dtype, shape, (c,))
                values[name] = t
            else:
                entries[name] = EntryInfo(name, "object", None, None, (ChunkInfo((), (), rel, 0, 0),))
                values[name] = v
        return cls(path, values), entries

    def chunk(self, info: EntryInfo, c: ChunkInfo) -> torch.Tensor:
        return self.values[info.name]

    def mapped(self, info: EntryInfo, c: ChunkInfo) -> None:
        return None  # torch owns the mapping: its tensors are copied from, never read around

    def advise(self, c: ChunkInfo, advice: int) -> None:
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
