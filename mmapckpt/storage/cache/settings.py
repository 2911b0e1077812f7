"""Whether a URL's reads go through the local cache, and where: ``storage_options`` or the environment.

``storage_options={"cache_dir": DIR}`` (or ``MMAPCKPT_CACHE_DIR=DIR``) turns the cache on for a URL;
``cache_max_bytes`` (or ``MMAPCKPT_CACHE_MAX_BYTES``) bounds it. Off unless asked for; ``cache_dir``
given as None or ``""`` turns it off even where the environment names one. These keys are taken out
of the options before the medium sees them (a medium refuses keys it does not know).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, NamedTuple

from ...errors import CheckpointError

__all__ = ["CacheSettings", "split_options", "ENV_DIR", "ENV_MAX_BYTES"]

ENV_DIR = "MMAPCKPT_CACHE_DIR"
ENV_MAX_BYTES = "MMAPCKPT_CACHE_MAX_BYTES"


class CacheSettings(NamedTuple):
    """The cache of remote files: its directory and its size bound (None: unbounded)."""

    root: str
    max_bytes: int | None


def split_options(options: Mapping[str, Any] | None) -> tuple[dict[str, Any], CacheSettings | None]:
    """``(the medium's options, the cache's settings or None)`` of a caller's ``storage_options``."""
    opts = dict(options or {})
    given = "cache_dir" in opts
    root = opts.pop("cache_dir", None)
    limit = opts.pop("cache_max_bytes", None)
    if not given:
        root = os.environ.get(ENV_DIR) or None
    if limit is None and os.environ.get(ENV_MAX_BYTES):
        limit = os.environ[ENV_MAX_BYTES]
    if not root:
        return opts, None
    try:
        max_bytes = None if limit is None else int(limit)
    except (TypeError, ValueError):
        max_bytes = -1
    if max_bytes is not None and max_bytes < 0:
        raise CheckpointError(f"cache_max_bytes (or {ENV_MAX_BYTES}) must be a whole number of bytes, not negative; "
                              f"got {limit!r}")
    return opts, CacheSettings(os.path.abspath(os.path.expanduser(os.fspath(root))), max_bytes)
