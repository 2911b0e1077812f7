"""Where a checkpoint's bytes live: the storage interface, the extension point for a new medium.

Every reader and writer of mmapckpt reaches a checkpoint's files through a
:class:`CheckpointStorage`: a location (a local directory, an ``s3://BUCKET/PREFIX``) whose files
are read through :class:`StoredFile` and written through :class:`FileOutput`, committed atomically,
listed, removed and locked (:class:`Lock`). :func:`storage_for` is how a path or URL becomes one.

A new medium is one module: subclass :class:`CheckpointStorage` (and :class:`StoredFile`,
:class:`FileOutput`, :class:`Lock`) keeping the contract their docstrings state, and serve its
URLs with ``register_scheme("scheme", factory)``; every API (``MmapWriter``/``MmapReader``,
``save``, ``open``/``load``/``load_into``/``load_model``, ``convert``, ``inspect``, ``verify``) then
takes ``scheme://...``. tests/storage/test_storage_contract.py checks the contract; a medium runs it
by adding one fixture (docs/api.md, "Adding a storage medium").

The names are imported on first use, as the package's own (``mmapckpt/__init__.py``).
"""

from __future__ import annotations

import importlib
import typing

#: public name -> the module (relative to this package) that defines it
_WHERE = {
    "CheckpointStorage": ".base",
    "StoredFile": ".base",
    "FileOutput": ".base",
    "Lock": ".base",
    "CommitFile": ".base",
    "storage_for": ".location",
    "register_scheme": ".location",
    "is_url": ".location",
    "StorageFactory": ".location",
    "LocalStorage": ".local",
}

__all__ = ["CheckpointStorage", "StoredFile", "FileOutput", "Lock", "CommitFile", "storage_for", "register_scheme",
           "is_url", "StorageFactory", "LocalStorage"]

if typing.TYPE_CHECKING:
    from .base import CheckpointStorage, CommitFile, FileOutput, Lock, StoredFile
    from .local import LocalStorage
    from .location import StorageFactory, is_url, register_scheme, storage_for


def __getattr__(name: str) -> typing.Any:
    """Import a public name's module on first use and keep the name here (PEP 562)."""
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(where, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
