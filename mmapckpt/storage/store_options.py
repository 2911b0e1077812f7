"""What the options of every object store share (``s3/options.py``, ``azure/options.py``, ``gcs/options.py``).

Each store's options are a frozen dataclass of its own settings (credentials, endpoint, timeouts) and these
common ones: ``part_size`` and ``concurrency`` of ranged GETs, ``upload_part_size`` and ``upload_concurrency``
of a shard's parts, ``retries``, and the save lock's ``lock_lease``, ``lock_wait`` and ``lock_job``
(``storage/leased_lock.py``, ``storage/holders.py``). :class:`StoreOptions` gives them the rules every store
keeps: an unknown option refused (a misspelt one would otherwise be ignored silently), the common bounds
checked, a repr that shows no credential (``storage/credentials.py``). :class:`Clients` keeps one client per
settings, shared between storages (each store's client is thread-safe).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from ..errors import CheckpointError
from .credentials import redact_value

__all__ = ["StoreOptions", "Clients", "MiB", "bucket_and_prefix"]

MiB = 1 << 20


@dataclasses.dataclass(frozen=True, repr=False)
class StoreOptions:
    """The options every store has, and the rules of a store's options dataclass, which extends this one (see the
    module docstring); ``scheme`` names the store's URLs."""

    scheme: ClassVar[str]
    part_size: int = 16 * MiB
    concurrency: int = 16
    upload_part_size: int = 16 * MiB
    upload_concurrency: int = 4
    retries: int = 5
    lock_lease: float = 30.0
    lock_wait: float = 60.0
    lock_job: str | None = None

    @classmethod
    def refuse_unknown(cls, given: Mapping[str, Any]) -> None:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(given) - names)
        if unknown:
            raise CheckpointError(f"storage_options: unknown option(s) {unknown} for {cls.scheme}:// (known: "
                                  f"{sorted(names)})")

    def check_bounds(self) -> None:
        """The transfers' sizes and counts positive (retries not negative), the lock's lease positive and its wait
        not negative."""
        if min(self.part_size, self.concurrency, self.upload_part_size, self.upload_concurrency) < 1 or \
                self.retries < 0:
            raise CheckpointError("storage_options: part_size, concurrency, upload_part_size and upload_concurrency "
                                  "must be positive, retries not negative")
        if not self.lock_lease > 0 or not self.lock_wait >= 0:
            raise CheckpointError("storage_options: lock_lease must be positive and lock_wait not negative (seconds)")

    def __repr__(self) -> str:
        shown = ", ".join(f"{f.name}={redact_value(f.name, getattr(self, f.name))!r}"
                          for f in dataclasses.fields(self))
        return f"{type(self).__name__}({shown})"


def bucket_and_prefix(url: str) -> tuple[str, str]:
    """``(bucket, prefix)`` of ``SCHEME://BUCKET/PREFIX`` (the prefix without slashes at either end; may be empty)."""
    scheme, _, rest = url.partition("://")
    bucket, _, prefix = rest.partition("/")
    if not bucket:
        raise CheckpointError(f"this {scheme}:// URL needs a bucket: {scheme}://BUCKET/PREFIX", path=url)
    return bucket, prefix.strip("/")


class Clients:
    """One client per key (the settings, and what of the environment the client reads), made on first use."""

    def __init__(self) -> None:
        self._clients: dict[Any, Any] = {}
        self._lock = threading.Lock()

    def get(self, key: Any, make: Callable[[], Any]) -> Any:
        with self._lock:
            client = self._clients.get(key)
            if client is None:
                client = self._clients[key] = make()
            return client
