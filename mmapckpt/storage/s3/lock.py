"""The save lock of an object-store prefix: a lock object created with a conditional write, leased.

An object store has no directory to ``flock``. A save takes the lock by creating the object
``PREFIX/.mmapckpt-lock`` with ``If-None-Match: *`` (S3 and stores with conditional writes
refuse the PUT with 412 when the object exists), and renews it every quarter lease by
rewriting it with ``If-Match`` on its own ETag. A process that dies stops renewing: once
the object is older than the lease (by the store's own clock: its ``Last-Modified`` against
the ``Date`` of the store's answer), the next save takes it over, again conditionally on the
stale ETag, so two saves cannot both take over one stale lock. :meth:`S3Lock.release` deletes it.

Where a store ignores the conditions (older S3-compatible servers), the lock is advisory:
a save first looks for a live lock object and refuses if there is one, and after writing its
own reads it back and refuses if another save's body is there, which catches all but saves
starting within the same few milliseconds (docs/object-storage.md). A per-rank save
(``use_collectives=False``, ``shared=True``) takes no lock: its ranks write disjoint files.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import uuid
from typing import Any

from ...errors import CheckpointWriteError
from ..base import Lock
from .failures import is_missing, is_precondition_failed, write_error

__all__ = ["S3Lock", "LOCK_NAME"]

#: The lock object's name under the prefix (not a DCP file name: nothing removes it but its owner,
#: or a save taking over a stale one).
LOCK_NAME = ".mmapckpt-lock"


class S3Lock(Lock):
    """The exclusive lock of one prefix, held from :meth:`__init__` until :meth:`release` (see the module)."""

    def __init__(self, client: Any, bucket: str, key: str, url: str, *, lease: float) -> None:
        self.client, self.bucket, self.key, self.url, self.lease = client, bucket, key, url, lease
        self.owner = uuid.uuid4().hex
        self.body = json.dumps({"owner": self.owner, "host": socket.gethostname(), "pid": os.getpid()}).encode()
        self.etag: str | None = None
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None
        #: set when a renewal found the lock taken over (this save stalled past its lease)
        self.lost = False
        self._take()
        self._renewer = threading.Thread(target=self._renew, name="mmapckpt-s3-lock", daemon=True)
        self._renewer.start()

    def _take(self) -> None:
        held = self._head()
        if held is not None and not _stale(held, self.lease):
            raise self._busy(held)
        try:
            if held is None:
                r = self.client.put_object(Bucket=self.bucket, Key=self.key, Body=self.body, IfNoneMatch="*")
            else:  # a dead save's lock: take it over, conditionally on the stale version
                r = self._put_if_match(held["ETag"])
        except Exception as e:
            if is_precondition_failed(e):
                raise self._busy(self._head()) from None
            raise write_error(e, self.url, what="taking the save lock") from e
        self.etag = r.get("ETag")
        # A store without conditional writes takes both PUTs unconditionally: read back whose lock it is.
        try:
            body = self.client.get_object(Bucket=self.bucket, Key=self.key)["Body"].read()
        except Exception as e:
            raise write_error(e, self.url, what="reading the save lock back") from e
        if body != self.body:
            raise self._busy(self._head())

    def _put_if_match(self, etag: str) -> dict[str, Any]:
        """Rewrite the lock object if it is still version ``etag``.

        ``If-Match`` takes the quoted ETag (RFC 9110, S3); Ceph radosgw 16.2 compares the unquoted
        one on PUT and refuses the quoted one with 412 although it matches. So a 412 is checked
        against the object: where it still has ``etag``, the unquoted spelling is sent instead.
        """
        try:
            return self.client.put_object(Bucket=self.bucket, Key=self.key, Body=self.body,  # type: ignore[no-any-return]
                                          IfMatch=etag)
        except Exception as e:
            if not (is_precondition_failed(e) and etag.startswith('"')):
                raise
            now = self._head()
            if now is None or now.get("ETag") != etag:
                raise
        return self.client.put_object(Bucket=self.bucket, Key=self.key, Body=self.body,  # type: ignore[no-any-return]
                                      IfMatch=etag.strip('"'))

    def _head(self) -> dict[str, Any] | None:
        try:
            return self.client.head_object(Bucket=self.bucket, Key=self.key)  # type: ignore[no-any-return]
        except Exception as e:
            if is_missing(e):
                return None
            raise write_error(e, self.url, what="looking for a save lock") from e

    def _busy(self, held: dict[str, Any] | None) -> CheckpointWriteError:
        since = held.get("LastModified") if held else None
        return CheckpointWriteError(
            f"another save or conversion holds this location's lock ({LOCK_NAME}"
            + (f", renewed {since:%Y-%m-%d %H:%M:%S %Z}" if since is not None else "")
            + f"); try again when it has finished. A lock its save stopped renewing expires after {self.lease:g} s",
            path=self.url)

    def _renew(self) -> None:
        while not self._stop.wait(self.lease / 4):
            try:
                r = self._put_if_match(self.etag)  # type: ignore[arg-type]
                self.etag = r.get("ETag", self.etag)
            except Exception as e:
                if is_precondition_failed(e) or is_missing(e):
                    self.lost = True
                    return
                # a transient failure: the next renewal tries again, well within the lease

    def release(self) -> None:
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join()
            self._renewer = None
        if self.etag is not None and not self.lost:
            self.etag = None
            try:
                self.client.delete_object(Bucket=self.bucket, Key=self.key)
            except Exception:
                pass  # left behind, it expires after the lease


def _stale(head: dict[str, Any], lease: float) -> bool:
    """Whether a lock object was last written more than ``lease`` seconds ago by the store's clock."""
    modified = head.get("LastModified")
    date = head.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
    if modified is None or date is None:
        return False
    from email.utils import parsedate_to_datetime
    try:
        now = parsedate_to_datetime(date)
    except (TypeError, ValueError):
        return False
    return (now - modified).total_seconds() > lease
