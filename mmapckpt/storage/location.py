"""Which storage a location names: the one place a path or URL becomes a ``CheckpointStorage``.

A local or mounted directory is a :class:`~mmapckpt.storage.local.LocalStorage`. A URL
(``s3://bucket/ckpt``) names no implemented medium yet and is refused with what to do, rather
than becoming a local directory called ``s3:``.
"""

from __future__ import annotations

import os

from ..errors import CheckpointError, CheckpointNotFoundError
from ..io.files import refuse_url
from .base import CheckpointStorage
from .local import LocalStorage

__all__ = ["storage_for"]


def storage_for(location: str | os.PathLike[str], *,
                error: type[CheckpointError] = CheckpointNotFoundError) -> CheckpointStorage:
    """The storage of the checkpoint at ``location`` (a directory path).

    Raises:
        ``error``: ``location`` is a URL.
    """
    s = os.fspath(location)
    refuse_url(s, error)
    return LocalStorage(s)
