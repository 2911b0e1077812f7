"""Ranged GETs of one object generation straight into the callers' buffers (``storage/ranged.py``).

Each request names the generation the object had when opened: GCS serves that generation or
nothing (an object replaced since has another generation, and the old one is gone without
versioning: 404), so a load never mixes two versions. The response is written into the request's
buffers as it arrives (``download_to_file`` into a writer over them, ``raw_download``: the bytes as
stored, the one copy google-cloud-storage allows).
"""

from __future__ import annotations

from typing import Any, Callable

from ..ranged import Into, RangedReads, replaced_while_read
from .failures import is_missing, is_precondition_failed, storage_error

__all__ = ["ObjectReads"]


class ObjectReads(RangedReads):
    """Ranged reads of generation ``generation`` of object ``key`` (``size`` bytes)."""

    pool_name = "gs"

    def __init__(self, bucket: Any, key: str, generation: int | None, size: int, url: str, part_size: int,
                 concurrency: int, on_fetch: Callable[[int, int], None] | None = None, *, retry: Any = None,
                 timeout: float = 60.0) -> None:
        super().__init__(size, url, part_size, concurrency, on_fetch)
        self.bucket, self.key, self.generation = bucket, key, generation
        self.retry, self.timeout = retry, timeout

    def _fetch(self, start: int, length: int, into: Into, entry: str | None) -> None:
        blob = self.bucket.blob(self.key, generation=self.generation)
        try:
            blob.download_to_file(into, start=start, end=start + length - 1, raw_download=True, checksum=None,
                                  **({"retry": self.retry} if self.retry is not None else {}), timeout=self.timeout)
        except Exception as e:
            if is_missing(e) or is_precondition_failed(e):
                raise replaced_while_read("object", self.url, entry, "replaced or removed") from None
            raise storage_error(e, self.url, what="reading", entry=entry) from e
