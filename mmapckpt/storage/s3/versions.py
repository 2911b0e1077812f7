"""Which version of an object the store holds now, without its bytes: what the local cache asks (storage/cache/),
as a mixin of :class:`~mmapckpt.storage.s3.storage.S3Storage`. A version is ``(size, ETag)``."""

from __future__ import annotations

from typing import Any

from .failures import is_missing, storage_error
from .lock import LOCK_NAME

__all__ = ["ObjectVersions"]


class ObjectVersions:
    """The versions of the objects of an :class:`S3Storage` (which gives ``client``, ``bucket``, ``key``, ``full``,
    ``location``, ``_dir``)."""

    client: Any
    bucket: str
    location: str
    key: Any
    full: Any
    _dir: Any

    def version(self, name: str) -> tuple[int, str] | None:
        """``(size, ETag)`` of object ``name``, None where there is none: one HEAD, no body."""
        try:
            h = self.client.head_object(Bucket=self.bucket, Key=self.key(name))
        except Exception as e:
            if is_missing(e):
                return None
            raise storage_error(e, self.full(name), what="looking up the object") from e
        return int(h["ContentLength"]), h.get("ETag", "")

    def versions(self) -> dict[str, tuple[int, str]]:
        """``{name: (size, ETag)}`` of the objects under the prefix (not below it): one LIST a thousand objects."""
        d, out = self._dir(), {}
        try:
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=d,
                                                                               Delimiter="/"):
                out.update((o["Key"][len(d):], (int(o["Size"]), o.get("ETag", ""))) for o in page.get("Contents", ()))
        except Exception as e:
            if is_missing(e):
                return {}
            raise storage_error(e, self.location, what="listing the checkpoint") from e
        out.pop(LOCK_NAME, None)
        out.pop("", None)
        return out

    @staticmethod
    def version_of(f: Any) -> tuple[int, str]:
        """The version of an object opened (an :class:`S3File`: its ident is ``(ETag, Last-Modified)``)."""
        return f.size, f.ident[0] or ""
