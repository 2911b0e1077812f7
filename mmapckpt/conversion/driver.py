"""Conversions between checkpoint formats: mmapckpt, stock DCP, safetensors, torch.save.

``convert(src, dst, to=...)`` reads the source one item at a time (_convert_src)
and streams it into a writer for the target format (_convert_dst), under a
temporary sibling of ``dst`` that is renamed into place only when complete.
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
import warnings
from dataclasses import dataclass

from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ..errors import CheckpointError, CheckpointExistsError, CheckpointWriteError
from ..io.files import fsync_dir
from ..io.progress import Progress
from .common import FORMATS, Source
from .detect import open_source
from .sinks import write_dcp, write_mmapckpt, write_safetensors, write_torch

__all__ = ["convert", "ConvertResult", "ConversionWarning", "parse_size", "FORMATS"]


class ConversionWarning(UserWarning):
    """Something in the source could not be carried into the target format (it is named)."""


@dataclass(frozen=True)
class ConvertResult:
    """What a conversion did.

    Attributes:
        source_format, target_format: formats, from FORMATS.
        path: the written checkpoint (``dst``).
        tensors: tensors written.
        tensor_bytes: bytes of tensor data written.
        dropped: non-tensor entries left out (see the warning).
    """

    source_format: str
    target_format: str
    path: str
    tensors: int
    tensor_bytes: int
    dropped: tuple[str, ...]


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)\s*$", re.IGNORECASE)
_UNIT = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
         "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_size(size: int | str) -> int:
    """``'5GB'`` -> 5*10**9, ``'512MiB'`` -> 512*2**20, ``1000`` -> 1000 (the Hugging Face convention)."""
    if isinstance(size, int) and not isinstance(size, bool):
        n = size
    else:
        m = _SIZE.match(str(size))
        if not m:
            raise ValueError(f"invalid size {size!r}; use e.g. 5GB, 500MB, 2GiB or a number of bytes")
        unit = m.group(2).lower()
        unit = unit[:-1] if unit.endswith("b") and unit != "b" else unit
        n = int(float(m.group(1)) * _UNIT[unit])
    if n <= 0:
        raise ValueError(f"size must be positive, got {size!r}")
    return n


def _check_paths(src: str, dst: str, overwrite: bool) -> None:
    rs, rd = os.path.realpath(src), os.path.realpath(dst)
    if rs == rd or rs.startswith(rd + os.sep):
        raise CheckpointError("the destination would replace the source; choose another destination", path=dst)
    if os.path.lexists(dst) and not overwrite:
        raise CheckpointExistsError("destination exists; pass overwrite=True (--overwrite) to replace it", path=dst)
    parent = os.path.dirname(os.path.abspath(dst))
    if not os.path.isdir(parent):
        raise CheckpointError("the destination's parent directory does not exist", path=parent)


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.unlink(path)


def _commit(tmp: str, dst: str, overwrite: bool) -> None:
    """Rename the finished ``tmp`` to ``dst``; an old ``dst`` is moved aside first and removed after."""
    parent = os.path.dirname(os.path.abspath(dst))
    old = None
    if os.path.lexists(dst):
        if not overwrite:
            raise CheckpointExistsError("destination appeared during the conversion", path=dst)
        old = os.path.join(parent, f".{os.path.basename(dst)}.old-{uuid.uuid4().hex[:8]}")
        os.rename(dst, old)
    os.rename(tmp, dst)
    fsync_dir(parent)
    if old is not None:
        _remove(old)


def convert(src: str | os.PathLike[str], dst: str | os.PathLike[str], *, to: str, overwrite: bool = False,
            max_shard_size: int | str | None = None, progress: bool = False) -> ConvertResult:
    """Convert the checkpoint at ``src`` into format ``to`` at ``dst``.

    The source format is detected. DCP <-> mmapckpt keeps the chunk layout, the
    metadata and the non-tensor entries. To safetensors/torch, chunks are assembled
    into full tensors named by their DCP fully-qualified names; safetensors drops
    non-tensor entries (with a ConversionWarning naming them). Memory stays at about
    the largest tensor plus a buffer.

    Args:
        src: a checkpoint directory (mmapckpt or stock DCP), a ``.safetensors`` file, a
            directory with ``model.safetensors.index.json``, or a ``torch.save`` file.
        dst: where to write; a directory for mmapckpt, dcp and sharded safetensors, else a file.
        to: one of ``"mmapckpt"``, ``"dcp"``, ``"safetensors"``, ``"torch"``.
        overwrite: replace an existing ``dst``.
        max_shard_size: for safetensors only: write HF-style shards of at most this size
            (bytes, or a string such as ``"5GB"``) plus ``model.safetensors.index.json``.
        progress: draw a progress bar on stderr when it is a terminal.

    Returns:
        A ConvertResult.

    Raises:
        CheckpointError: the source is missing or damaged, the destination exists, or a
            tensor cannot be stored in the target format (all name the file and entry).

    Example:
        >>> convert("ckpt/step100", "model.safetensors", to="safetensors")  # doctest: +SKIP
    """
    if to not in FORMATS:
        raise ValueError(f"unknown target format {to!r}; choose one of {', '.join(FORMATS)}")
    if max_shard_size is not None and to != "safetensors":
        raise ValueError("max_shard_size applies only to safetensors output")
    limit = parse_size(max_shard_size) if max_shard_size is not None else None
    src_s, dst_s = os.fspath(src), os.fspath(dst)
    dst_s = dst_s.rstrip("/" + os.sep) or dst_s  # "out/" names the entry "out" (its temp sibling is ".out.tmp-*")
    _check_paths(src_s, dst_s, overwrite)
    tmp = os.path.join(os.path.dirname(os.path.abspath(dst_s)), f".{os.path.basename(dst_s)}.tmp-{uuid.uuid4().hex[:8]}")
    with open_source(src_s) as source:
        tensors = [md for _, md in source.items() if isinstance(md, TensorStorageMetadata)]
        total = sum(md.properties.dtype.itemsize * _numel(md.size) for md in tensors)
        bar = Progress(total, f"{source.kind} -> {to}", enabled=progress)
        try:
            with bar:
                dropped = _write(source, tmp, to, limit, os.path.abspath(dst_s), bar)
            _commit(tmp, dst_s, overwrite)
        except OSError as e:
            _remove(tmp)
            if isinstance(e, CheckpointError):
                raise
            raise CheckpointWriteError(f"conversion failed: {e}", path=dst_s) from e
        except BaseException:
            _remove(tmp)
            raise
    if dropped:
        why = "safetensors holds only tensors" if to == "safetensors" else \
            "they cannot be unpickled safely (weights_only=True)"
        warnings.warn(f"{len(dropped)} non-tensor entries were not converted ({why}): {', '.join(dropped)}",
                      ConversionWarning, stacklevel=2)
    return ConvertResult(source.kind, to, dst_s, len(tensors), total, tuple(dropped))


def _numel(size: tuple[int, ...]) -> int:
    n = 1
    for s in size:
        n *= s
    return n


def _write(source: Source, tmp: str, to: str, limit: int | None, final: str, bar: Progress) -> list[str]:
    if to == "mmapckpt":
        write_mmapckpt(source, tmp, checkpoint_id=final, progress=bar)
        return []
    if to == "dcp":
        write_dcp(source, tmp, checkpoint_id=final, progress=bar)
        return []
    if to == "safetensors":
        return write_safetensors(source, tmp, max_shard_size=limit, progress=bar)
    return write_torch(source, tmp, progress=bar)
