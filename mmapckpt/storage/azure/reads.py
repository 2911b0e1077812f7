"""Ranged GETs of one blob version straight into the callers' buffers (``storage/ranged.py``).

Each response is written into the request's buffers as it arrives (``StorageStreamDownloader.readinto``
into a writer over them: the one copy azure-storage-blob allows). Every GET carries ``If-Match`` with
the ETag the blob had when opened: a blob replaced meanwhile fails the read (412), never mixing two
versions.
"""

from __future__ import annotations

from typing import Any, Callable

from ..ranged import Into, RangedReads, replaced_while_read
from .failures import is_missing, status, storage_error

__all__ = ["BlobReads"]


class BlobReads(RangedReads):
    """Ranged reads of one blob version (``etag``) of ``size`` bytes."""

    pool_name = "az"

    def __init__(self, blob: Any, etag: str | None, size: int, url: str, part_size: int, concurrency: int,
                 on_fetch: Callable[[int, int], None] | None = None) -> None:
        super().__init__(size, url, part_size, concurrency, on_fetch)
        self.blob, self.etag = blob, etag

    def _fetch(self, start: int, length: int, into: Into, entry: str | None) -> None:
        from azure.core import MatchConditions
        kwargs: dict[str, Any] = {"etag": self.etag, "match_condition": MatchConditions.IfNotModified} if self.etag else {}
        try:
            self.blob.download_blob(offset=start, length=length, max_concurrency=1, **kwargs).readinto(into)
        except Exception as e:
            if status(e) == 412:
                raise replaced_while_read("blob", self.url, entry) from None
            if is_missing(e):
                raise replaced_while_read("blob", self.url, entry, "removed") from None
            raise storage_error(e, self.url, what="reading", entry=entry) from e
