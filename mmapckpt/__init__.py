"""mmapckpt: fast, safe PyTorch checkpoints as raw, aligned tensor bytes.

A drop-in ``StorageWriter``/``StorageReader`` for ``torch.distributed.checkpoint``, and
single-process ``save``, ``open``/``load`` (lazy views) and ``load_into`` (in place).

The names are imported on first use (PEP 562 ``__getattr__``), so ``import mmapckpt``, the
command line's ``--help`` and ``--version`` and ``mmapckpt.__version__`` do not import torch;
``from mmapckpt import save`` and ``mmapckpt.save`` import what ``save`` needs.
"""

import importlib
import typing

from ._version import __version__

#: public name -> the module (relative to this package) that defines it. A new name goes here, in __all__ and
#: in the TYPE_CHECKING block (tests/test_public_api.py checks that the three agree).
_WHERE = {
    "MmapWriter": ".dcp.writer",
    "MmapReader": ".dcp.reader",
    "PinnedStager": ".dcp.stager",
    "save": ".saving",
    "SavedCheckpoint": ".saving",
    "open": ".lazy",
    "load": ".lazy",
    "load_into": ".into",
    "load_model": ".model",
    "LazyCheckpoint": ".lazy",
    "TensorSlice": ".lazy",
    "EntryInfo": ".lazy",
    "ChunkInfo": ".lazy",
    "ZeroCopyLoadPlanner": ".dcp.planner",
    "SafeLoadPlanner": ".dcp.planner",
    "FastLoadPlanner": ".dcp.fast_planner",
    "FastSavePlanner": ".dcp.fast_planner",
    "convert": ".conversion.driver",
    "ConvertResult": ".conversion.driver",
    "ConversionWarning": ".conversion.driver",
    "inspect_checkpoint": ".tools.describe",
    "CheckpointInfo": ".tools.describe",
    "verify_checkpoint": ".tools.verify",
    "VerifyReport": ".tools.verify",
    "CheckpointError": ".errors",
    "CheckpointNotFoundError": ".errors",
    "IncompleteCheckpointError": ".errors",
    "CheckpointExistsError": ".errors",
    "FormatError": ".errors",
    "BadMagicError": ".errors",
    "UnsupportedVersionError": ".errors",
    "ByteOrderError": ".errors",
    "TruncatedFileError": ".errors",
    "EntryBoundsError": ".errors",
    "UnknownDtypeError": ".errors",
    "UnsafePathError": ".errors",
    "UnsafePickleError": ".errors",
    "ChecksumError": ".errors",
    "SizeMismatchError": ".errors",
    "CastError": ".errors",
    "ModelMismatchError": ".errors",
    "CheckpointWriteError": ".errors",
    "StorageAccessError": ".errors",
    "StorageUnavailableError": ".errors",
    "checkpoint_error": ".dcp.unwrap",
    "CheckpointManager": ".manage.manager",
}

__all__ = [
    "MmapWriter", "MmapReader", "PinnedStager", "save", "SavedCheckpoint", "open", "load", "load_into", "load_model", "LazyCheckpoint",
    "TensorSlice",
    "EntryInfo", "ChunkInfo", "ZeroCopyLoadPlanner", "SafeLoadPlanner", "FastLoadPlanner", "FastSavePlanner",
    "convert", "ConvertResult", "ConversionWarning", "inspect_checkpoint", "CheckpointInfo",
    "verify_checkpoint", "VerifyReport", "CheckpointError", "CheckpointNotFoundError",
    "IncompleteCheckpointError", "CheckpointExistsError", "FormatError", "BadMagicError",
    "UnsupportedVersionError", "ByteOrderError", "TruncatedFileError", "EntryBoundsError", "UnknownDtypeError",
    "UnsafePathError", "UnsafePickleError", "ChecksumError", "SizeMismatchError", "CastError",
    "ModelMismatchError", "CheckpointWriteError",
    "StorageAccessError", "StorageUnavailableError", "checkpoint_error", "CheckpointManager", "__version__",
]

if typing.TYPE_CHECKING:  # what type checkers and IDEs see: the same names, imported eagerly
    from .conversion.driver import ConversionWarning, ConvertResult, convert
    from .dcp.fast_planner import FastLoadPlanner, FastSavePlanner
    from .dcp.planner import SafeLoadPlanner, ZeroCopyLoadPlanner
    from .dcp.reader import MmapReader
    from .dcp.stager import PinnedStager
    from .dcp.unwrap import checkpoint_error
    from .dcp.writer import MmapWriter
    from .errors import (
        BadMagicError,
        ByteOrderError,
        CastError,
        CheckpointError,
        CheckpointExistsError,
        CheckpointNotFoundError,
        CheckpointWriteError,
        ChecksumError,
        EntryBoundsError,
        FormatError,
        IncompleteCheckpointError,
        ModelMismatchError,
        SizeMismatchError,
        StorageAccessError,
        StorageUnavailableError,
        TruncatedFileError,
        UnknownDtypeError,
        UnsafePathError,
        UnsafePickleError,
        UnsupportedVersionError,
    )
    from .into import load_into
    from .manage.manager import CheckpointManager
    from .lazy import ChunkInfo, EntryInfo, LazyCheckpoint, TensorSlice, load, open
    from .model import load_model
    from .saving import SavedCheckpoint, save
    from .tools.describe import CheckpointInfo, inspect_checkpoint
    from .tools.verify import VerifyReport, verify_checkpoint


def __getattr__(name: str) -> typing.Any:
    """Import a public name's module on first use and keep the name here (PEP 562)."""
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(where, __name__), name)
    globals()[name] = value  # later lookups do not come back here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
