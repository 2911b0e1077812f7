"""The save lock of an ``s3://`` prefix: the store's primitives of the leased lock (``storage/leased_lock.py``).

The lock object is created with ``If-None-Match: *`` (the store refuses the PUT with 412 where it
exists), renewed with ``If-Match`` on its own ETag, and its age is told by the store's clock: the
object's ``Last-Modified`` against the ``Date`` of the store's answer. :meth:`S3Lock.release` reads and
compares, then DELETEs with ``If-Match``, which Ceph 16.2 ignores: there the window is between the read
and the DELETE, less than the three quarters of a lease left after the last renewal.
"""

from __future__ import annotations

import json
from email.utils import parsedate_to_datetime
from typing import Any

from ..leased_lock import LEGACY_LEASE, LOCK_NAME, LeasedLock
from .failures import FAILURES, is_precondition_failed

__all__ = ["S3Lock", "LOCK_NAME", "put_if", "LEGACY_LEASE"]


def put_if(client: Any, bucket: str, key: str, body: bytes, etag: str | None) -> dict[str, Any]:
    """PUT ``body`` at ``key`` if the object is still version ``etag`` (None: if there is no object).

    ``If-Match`` takes the quoted ETag (RFC 9110, S3); Ceph radosgw 16.2 compares the unquoted one
    on PUT and refuses the quoted one with 412 although it matches. So a 412 is checked against
    the object: where it still has ``etag``, the unquoted spelling is sent instead (again
    conditionally). A refused condition raises botocore's error (``is_precondition_failed``).
    """
    if etag is None:
        return client.put_object(Bucket=bucket, Key=key, Body=body, IfNoneMatch="*")  # type: ignore[no-any-return]
    try:
        return client.put_object(Bucket=bucket, Key=key, Body=body, IfMatch=etag)  # type: ignore[no-any-return]
    except Exception as e:
        if not (is_precondition_failed(e) and etag.startswith('"')):
            raise
        try:
            now = client.head_object(Bucket=bucket, Key=key).get("ETag")
        except Exception:
            now = None
        if now != etag:
            raise e from None
    return client.put_object(Bucket=bucket, Key=key, Body=body, IfMatch=etag.strip('"'))  # type: ignore[no-any-return]


class S3Lock(LeasedLock):
    """The exclusive lock of one prefix, held from :meth:`__init__` until :meth:`release` (``LeasedLock``)."""

    thread_name = "mmapckpt-s3-lock"
    failures = FAILURES

    def __init__(self, client: Any, bucket: str, key: str, url: str, *, lease: float, wait: float,
                 job: str | None) -> None:
        super().__init__(url, lease=lease, wait=wait, job=job)
        self.client, self.bucket, self.key = client, bucket, key
        self._hold()

    def _read(self) -> tuple[dict[str, Any], Any, float | None] | None:
        r = self.client.get_object(Bucket=self.bucket, Key=self.key)
        data = r["Body"].read()
        try:
            holder = json.loads(data)
        except ValueError:
            holder = None
        return (holder if isinstance(holder, dict) else {}), r.get("ETag", ""), _store_age(r)

    def _write(self, body: bytes, version: Any) -> Any:
        return put_if(self.client, self.bucket, self.key, body, version).get("ETag")

    def _version_now(self) -> Any:
        return self.client.head_object(Bucket=self.bucket, Key=self.key).get("ETag")

    def _delete(self, version: Any) -> None:
        if self._version_now() == version:
            self.client.delete_object(Bucket=self.bucket, Key=self.key, IfMatch=version)


def _store_age(r: dict[str, Any]) -> float | None:
    """Seconds since the object was last written, by the store's clock; None where the store sent no ``Date``."""
    modified = r.get("LastModified")
    date = r.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
    if modified is None or date is None:
        return None
    try:
        return (parsedate_to_datetime(date) - modified).total_seconds()
    except (TypeError, ValueError):
        return None
