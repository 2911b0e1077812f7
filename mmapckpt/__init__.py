"""mmapckpt: fast, safe PyTorch checkpoints as raw, aligned tensor bytes.

A drop-in ``StorageWriter``/``StorageReader`` for ``torch.distributed.checkpoint``.
"""

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
    SizeMismatchError,
    TruncatedFileError,
    UnknownDtypeError,
    UnsafePathError,
    UnsafePickleError,
    UnsupportedVersionError,
)
from .lazy import ChunkInfo, EntryInfo, LazyCheckpoint, TensorSlice, load, open
from .planner import SafeLoadPlanner, ZeroCopyLoadPlanner
from .reader import MmapReader
from .writer import MmapWriter

__version__ = "0.1.0"

__all__ = [
    "MmapWriter",
    "MmapReader",
    "open",
    "load",
    "LazyCheckpoint",
    "TensorSlice",
    "EntryInfo",
    "ChunkInfo",
    "ZeroCopyLoadPlanner",
    "SafeLoadPlanner",
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
    "CheckpointWriteError",
    "__version__",
]
