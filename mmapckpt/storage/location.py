"""Which storage a location names: the one place a path or URL becomes a ``CheckpointStorage``.

A local or mounted directory is a :class:`~mmapckpt.storage.local.LocalStorage`. A URL
(``scheme://...``) is the storage registered for its scheme (:func:`register_scheme`: ``s3``
is served by ``storage/s3/``, imported on first use; tests register a medium without mappings); a
URL of any other scheme is refused with what to do, rather than becoming a local directory
called ``s3:``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

from ..errors import CheckpointError, CheckpointNotFoundError
from .base import CheckpointStorage
from .local import LocalStorage

__all__ = ["storage_for", "register_scheme", "is_url", "StorageFactory"]

#: The storage of a URL of a scheme: ``factory(url, options)``, ``options`` the caller's
#: ``storage_options`` (``{}`` where none were given).
StorageFactory = Callable[[str, Mapping[str, Any]], CheckpointStorage]



def _s3(url: str, options: Mapping[str, Any]) -> CheckpointStorage:
    """``s3://BUCKET/PREFIX``: imported on first use (the ``s3`` extra's boto3 is imported then)."""
    from .s3.storage import S3Storage
    return S3Storage(url, options)


def _azure(url: str, options: Mapping[str, Any]) -> CheckpointStorage:
    """``az://CONTAINER/PREFIX`` (and ``abfs://``): the ``azure`` extra's azure-storage-blob, imported on first use."""
    from .azure.storage import AzureStorage
    return AzureStorage(url, options)


def _gcs(url: str, options: Mapping[str, Any]) -> CheckpointStorage:
    """``gs://BUCKET/PREFIX``: the ``gcs`` extra's google-cloud-storage, imported on first use."""
    from .gcs.storage import GCSStorage
    return GCSStorage(url, options)


#: scheme -> the storage of a URL of that scheme
_SCHEMES: dict[str, StorageFactory] = {"s3": _s3}


def is_url(location: str | os.PathLike[str]) -> bool:
    """Whether ``location`` is a URL (``scheme://...``) rather than a path."""
    return "://" in os.fspath(location)


def register_scheme(scheme: str, factory: StorageFactory | None) -> None:
    """Serve URLs ``scheme://...`` with ``factory(url, options)`` (None: stop serving them)."""
    if factory is None:
        _SCHEMES.pop(scheme, None)
    else:
        _SCHEMES[scheme] = factory


def storage_for(location: str | os.PathLike[str], *, error: type[CheckpointError] = CheckpointNotFoundError,
                options: Mapping[str, Any] | None = None) -> CheckpointStorage:
    """The storage of the checkpoint at ``location`` (a directory path, or a URL of a registered scheme).

    ``options`` (a caller's ``storage_options``: credentials, endpoint, request sizes) go to the
    medium of a URL, but for ``cache_dir`` and ``cache_max_bytes``: with a cache asked for (those, or
    ``MMAPCKPT_CACHE_DIR``), a medium without mappings is served through it (storage/cache/); a local directory takes none and ignores them, so that one script can
    name either.

    Raises:
        ``error``: ``location`` is a URL of a scheme no storage serves.
    """
    s = os.fspath(location)
    if is_url(s):
        factory = _SCHEMES.get(s.split("://", 1)[0])
        if factory is not None:
            from .cache.settings import split_options
            medium_options, cache = split_options(options)
            storage = factory(s, medium_options)
            if cache is None or storage.can_map:
                return storage
            from .cache.storage import CachedStorage
            return CachedStorage(storage, cache)
        served = ", ".join(f"{k}://" for k in sorted(_SCHEMES))
        raise error(f"{s!r} is a URL of a scheme no storage serves: mmapckpt reads and writes local (or mounted) "
                    f"paths and URLs of the registered media ({served}; storage/location.py register_scheme adds "
                    "one). Copy the checkpoint to a local disk or one of those, or mount the storage and pass "
                    "that path", path=s)
    return LocalStorage(s)


# the media of this package, served through the public extension point as any other would be
for _scheme, _factory in (("az", _azure), ("abfs", _azure), ("gs", _gcs)):
    register_scheme(_scheme, _factory)
