"""Errors raised for problems with a checkpoint's content or location.

Every problem with a checkpoint raises :class:`CheckpointError` or a subclass.
Each subclass also derives from the built-in exception users already catch::

    Exception
    └── CheckpointError
        ├── CheckpointNotFoundError      (FileNotFoundError)  no checkpoint at the path
        ├── IncompleteCheckpointError    (FileNotFoundError)  no committed metadata, or a shard it names is missing
        ├── CheckpointExistsError        (FileExistsError,    overwrite=False and a checkpoint is there
        │                                 RuntimeError)       (RuntimeError, as stock DCP raises)
        ├── FormatError                  (ValueError)         bytes that do not follow the format
        │   ├── BadMagicError                                 not an mmapckpt file
        │   ├── UnsupportedVersionError                       a format version this reader does not know
        │   ├── ByteOrderError                                data byte order differs from the host's
        │   ├── TruncatedFileError                            file shorter than its header says
        │   ├── EntryBoundsError                              entry overlapping, duplicated or misaligned
        │   ├── UnknownDtypeError                             dtype name not in the format's table
        │   ├── UnsafePathError                               metadata path leaving the checkpoint directory
        │   └── UnsafePickleError                             stock metadata naming a class outside DCP's
        ├── ChecksumError                (ValueError)         data bytes do not match their checksum
        ├── SizeMismatchError            (ValueError)         stored chunk and target disagree
        ├── CastError                    (TypeError)          a cast that would change stored values (allow_cast=)
        ├── ModelMismatchError           (RuntimeError)       checkpoint and model disagree (load_model): missing or
        │                                                     unexpected names, a tensor nothing can fill
        ├── CheckpointWriteError         (OSError)            a save failed (disk full, permissions)
        ├── StorageAccessError           (PermissionError)    an object store refused the credentials
        └── StorageUnavailableError      (ConnectionError)    an object store unreachable, or failing past its retries

Messages name the file, the entry and what is wrong.
"""

from __future__ import annotations

import os

__all__ = [
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
    "CastError",
    "ModelMismatchError",
    "CheckpointWriteError",
    "StorageAccessError",
    "StorageUnavailableError",
]


class CheckpointError(Exception):
    """Root of all mmapckpt errors about a checkpoint.

    Args:
        message: what is wrong and what to do about it.
        path: the file or directory concerned, if known.
        entry: the entry concerned, if any.

    Attributes:
        path: the file or directory concerned, if known.
        entry: the entry (fully-qualified name, with chunk offsets) concerned, if any.
    """

    def __init__(
        self,
        message: str,
        *,
        path: str | os.PathLike[str] | None = None,
        entry: str | None = None,
    ) -> None:
        self.path = os.fspath(path) if path is not None else None
        self.entry = entry
        parts = []
        if self.path is not None:
            parts.append(self.path)
        if entry is not None:
            parts.append(f"entry {entry!r}")
        prefix = ": ".join(parts)
        self.message = message
        super().__init__(f"{prefix}: {message}" if prefix else message)

    def __reduce__(self):  # keep the keyword arguments across pickling (DCP gathers errors)
        return (_rebuild, (type(self), self.message, self.path, self.entry))

    def __str__(self) -> str:  # OSError subclasses would otherwise format their own way
        return str(self.args[0]) if self.args else self.message


def _rebuild(cls, message, path, entry):
    return cls(message, path=path, entry=entry)


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """There is no checkpoint at the given path."""


class IncompleteCheckpointError(CheckpointError, FileNotFoundError):
    """The checkpoint is not whole: no committed metadata (a save did not finish), or a shard it names is missing."""


class CheckpointExistsError(CheckpointError, FileExistsError, RuntimeError):
    """A checkpoint already exists and overwriting was not allowed.

    Also a RuntimeError, which the stock FileSystemWriter raises in this case (code and
    PyTorch's own tests catch that, and match "Checkpoint already exists").
    """


class FormatError(CheckpointError, ValueError):
    """The bytes of a checkpoint file do not follow the format."""


class BadMagicError(FormatError):
    """The file does not start with the mmapckpt magic bytes."""


class UnsupportedVersionError(FormatError):
    """The file's format version is newer (or older) than this reader supports."""


class ByteOrderError(FormatError):
    """The file's data byte order does not match this host's."""


class TruncatedFileError(FormatError):
    """The file ends before the data its header describes."""


class EntryBoundsError(FormatError):
    """An entry lies outside its file, overlaps another, or is misaligned."""


class UnknownDtypeError(FormatError):
    """An entry names a dtype that is not in the format's dtype table."""


class UnsafePathError(FormatError):
    """Metadata names a file outside the checkpoint directory."""


class UnsafePickleError(FormatError):
    """A stock DCP metadata pickle refers to something other than DCP metadata classes."""


class ChecksumError(CheckpointError, ValueError):
    """An entry's data does not match its stored checksum."""


class SizeMismatchError(CheckpointError, ValueError):
    """A stored chunk does not fit the tensor it is loaded into."""


class CastError(CheckpointError, TypeError):
    """Casting stored values to the target's dtype would change them beyond rounding: floating point or complex
    into integers, complex into real, or a value outside the target dtype's range (format/casts.py). A TypeError,
    as ``load_into`` raised for lossy casts before this class; ``allow_cast=True`` casts anyway."""


class ModelMismatchError(CheckpointError, RuntimeError):
    """The checkpoint does not fit the model: names missing or unexpected (``load_model(strict=True)``),
    tied weights stored with different values, or a tensor left on the meta device that neither the
    checkpoint nor the model's own initialisation can fill. A RuntimeError, as ``load_state_dict`` raises."""


class CheckpointWriteError(CheckpointError, OSError):
    """Writing a checkpoint failed; no committed checkpoint was left behind."""



class StorageAccessError(CheckpointError, PermissionError):
    """The storage refused the request: wrong or missing credentials, or no permission (object stores)."""


class StorageUnavailableError(CheckpointError, ConnectionError):
    """The storage could not be reached, or kept failing after the retries allowed (object stores)."""
