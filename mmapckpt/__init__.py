"""mmapckpt: fast, safe PyTorch checkpoints as raw, aligned tensor bytes.

A drop-in ``StorageWriter``/``StorageReader`` for ``torch.distributed.checkpoint``, and
single-process ``save``, ``open``/``load`` (lazy views) and ``load_into`` (in place).
"""

from .conversion.driver import ConversionWarning, ConvertResult, convert
from .dcp.fast_planner import FastLoadPlanner, FastSavePlanner
from .dcp.planner import SafeLoadPlanner, ZeroCopyLoadPlanner
from .dcp.reader import MmapReader
from .dcp.unwrap import checkpoint_error
from .dcp.writer import MmapWriter
from .errors import (
    BadMagicError,
    ByteOrderError,
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
from .lazy import ChunkInfo, EntryInfo, LazyCheckpoint, TensorSlice, load, open
from .model import load_model
from .saving import save
from .tools.describe import CheckpointInfo, inspect_checkpoint
from .tools.verify import VerifyReport, verify_checkpoint

__version__ = "0.1.0"

__all__ = [
    "MmapWriter",
    "MmapReader",
    "save",
    "open",
    "load",
    "load_into",
    "load_model",
    "LazyCheckpoint",
    "TensorSlice",
    "EntryInfo",
    "ChunkInfo",
    "ZeroCopyLoadPlanner",
    "SafeLoadPlanner",
    "FastLoadPlanner",
    "FastSavePlanner",
    "convert",
    "ConvertResult",
    "ConversionWarning",
    "inspect_checkpoint",
    "CheckpointInfo",
    "verify_checkpoint",
    "VerifyReport",
    "CheckpointError",
    "CheckpointNotFoundError",
    "IncompleteCheckpointError",
    "CheckpointExistsError",
    "FormatError",
    "BadMagicError",
    "UnsupportedVersionError",
    "ByteOrderError",
    "TruncatedFileError",
    "EntryBoundsError",
    "UnknownDtypeError",
    "UnsafePathError",
    "UnsafePickleError",
    "ChecksumError",
    "SizeMismatchError",
    "ModelMismatchError",
    "CheckpointWriteError",
    "StorageAccessError",
    "StorageUnavailableError",
    "checkpoint_error",
    "__version__",
]
