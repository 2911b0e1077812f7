"""Which version of an object the store holds now, without its bytes: what the local cache asks at every open
(storage/cache/), as a mixin of :class:`~mmapckpt.storage.s3.storage.S3Storage`."""

from __future__ import annotations

from typing import Any

from .failures import is_missing, storage_error

__all__ = ["ObjectVersions"]


class ObjectVersions:
    """``version(name)``: one HEAD of object ``name`` (the storage gives ``client``, ``bucket``, ``key``, ``full``)."""

    client: Any
    bucket: str
    key: Any
    full: Any

    def version(self, name: str) -> tuple[int, Any] | None:
        """``(size, identity)`` of object ``name``, the identity as :attr:`S3File.ident` names it (ETag,
        Last-Modified); None where there is none. One HEAD, no body."""
        try:
            h = self.client.head_object(Bucket=self.bucket, Key=self.key(name))
        except Exception as e:
            if is_missing(e):
                return None
            raise storage_error(e, self.full(name), what="looking up the object") from e
        return int(h["ContentLength"]), (h.get("ETag"), h.get("LastModified"))
