"""Which storage a location names: the one place a path or URL becomes a ``CheckpointStorage``.

A local or mounted directory is a :class:`~mmapckpt.storage.local.LocalStorage`. A URL
(``scheme://...``) is the storage registered for its scheme (:func:`register_scheme`: the
object-store implementation registers ``s3``; tests register a medium without mappings); a
URL of any other scheme is refused with what to do, rather than becoming a local directory
called ``s3:``.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from ..errors import CheckpointError, CheckpointNotFoundError
from ..io.files import refuse_url
from .base import CheckpointStorage
from .local import LocalStorage

__all__ = ["storage_for", "register_scheme", "is_url"]

#: scheme -> the storage of a URL of that scheme
_SCHEMES: dict[str, Callable[[str], CheckpointStorage]] = {}


def is_url(location: str | os.PathLike[str]) -> bool:
    """Whether ``location`` is a URL (``scheme://...``) rather than a path."""
    return "://" in os.fspath(location)


def register_scheme(scheme: str, factory: Callable[[str], CheckpointStorage] | None) -> None:
    """Serve URLs ``scheme://...`` with ``factory(url)`` (None: stop serving them)."""
    if factory is None:
        _SCHEMES.pop(scheme, None)
    else:
        _SCHEMES[scheme] = factory


def storage_for(location: str | os.PathLike[str], *,
                error: type[CheckpointError] = CheckpointNotFoundError) -> CheckpointStorage:
    """The storage of the checkpoint at ``location`` (a directory path, or a URL of a registered scheme).

    Raises:
        ``error``: ``location`` is a URL of a scheme no storage serves.
    """
    s = os.fspath(location)
    if is_url(s):
        factory = _SCHEMES.get(s.split("://", 1)[0])
        if factory is not None:
            return factory(s)
        refuse_url(s, error)
    return LocalStorage(s)
