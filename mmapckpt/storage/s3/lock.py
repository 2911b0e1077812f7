"""The save lock of an object-store prefix: a leased lock object, taken and renewed with conditional writes.

An object store has no directory to ``flock``. A save takes the lock by creating the object
``PREFIX/.mmapckpt-lock`` with ``If-None-Match: *`` (the store refuses the PUT with 412 where
it exists) and renews it every quarter lease by rewriting it with ``If-Match`` on its own ETag
(each renewal's body differs, so its ETag changes). The object records its holder: a random
owner id, host, boot id, PID namespace, pid and process start time, its job, and its lease
(``storage/holders.py``).

A contender that finds the lock held takes it over (again conditionally, on the ETag it
found, so two contenders cannot both take one lock):

- at once where it can tell the holder is dead (its process gone on this machine, or an
  earlier run of the same job: ``holders.dead_because``);
- once the holder stopped renewing for longer than *the holder's* lease (plus the store
  clock's one-second granularity), by the store's clock: the object's ``Last-Modified``
  against the ``Date`` of the store's answer; where the store sends no ``Date``, once the
  object's ETag stayed the same for that long on the contender's own monotonic clock;
- otherwise it waits, up to ``lock_wait`` seconds, logging once whom it waits for, and then
  raises CheckpointWriteError.

**Fencing.** A holder that stalls (a GC pause, a stopped container) past its lease can lose
the lock while it still means to commit. :meth:`S3Lock.check` proves the lock is still held
just before a commit: not lost at a renewal, its last renewal less than a lease ago on this
process's monotonic clock, and the lock object still its own ETag. The commit itself is then
conditional on the version of the committed object that the save saw when it took the lock
(``S3Storage.commit``), which closes the window between the check and the PUT: a save that
commits after another save's commit is refused with 412, and a save that lost the lock before
it is refused at the check. :meth:`S3Lock.release` deletes the object only while it is still
its own (read and compare, then a DELETE with ``If-Match``, which Ceph 16.2 ignores: there the
window is between the read and the DELETE, less than the three quarters of a lease left after
the last renewal).

Where a store ignores the conditions, the lock is advisory: after writing its own a save reads
it back and refuses if another save's body is there, and the check before the commit remains
(docs/object-storage.md). A per-rank save (``use_collectives=False``, ``shared=True``) takes no
lock: its ranks write disjoint files.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from email.utils import parsedate_to_datetime
from typing import Any

from ...errors import CheckpointWriteError
from ..base import Lock
from ..holders import dead_because, describe, this_process
from .failures import is_missing, is_precondition_failed, write_error

__all__ = ["S3Lock", "LOCK_NAME", "put_if", "LEGACY_LEASE"]

#: The lock object's name under the prefix (not a DCP file name: nothing removes it but its owner,
#: or a save taking over a stale one).
LOCK_NAME = ".mmapckpt-lock"
#: The lease of a lock object that names none (an older mmapckpt's, whose default lease this was).
LEGACY_LEASE = 120.0
#: The store's clocks count whole seconds: a lock is stale only this much after its holder's lease.
_CLOCK_GRAIN = 1.0

_log = logging.getLogger("mmapckpt")


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


class S3Lock(Lock):
    """The exclusive lock of one prefix, held from :meth:`__init__` until :meth:`release` (see the module).

    Attributes:
        lease: seconds the lock lives without renewal (renewed every quarter of it).
        wait: seconds a contender waits for a live holder before it raises.
        lost: set when a renewal or :meth:`check` found the lock taken over.
    """

    def __init__(self, client: Any, bucket: str, key: str, url: str, *, lease: float, wait: float,
                 job: str | None) -> None:
        self.client, self.bucket, self.key, self.url = client, bucket, key, url
        self.lease, self.wait = lease, wait
        self.me = this_process(job, lease)
        self.etag: str | None = None
        self.lost = False
        self.released = False
        self._renewals = 0
        self._valid_until = 0.0  # monotonic: the last write of the lock object sent + the lease
        self._mutex = threading.Lock()  # a renewal and a check (or release) never overlap
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None
        self._take()
        self._renewer = threading.Thread(target=self._renew, name="mmapckpt-s3-lock", daemon=True)
        self._renewer.start()

    # ------------------------------------------------------------------ taking
    def _body(self) -> bytes:
        return json.dumps({**self.me, "renewed": self._renewals}).encode()

    def _take(self) -> None:
        deadline = time.monotonic() + self.wait
        seen: tuple[str | None, float] = (None, 0.0)  # (ETag, when first seen): the no-Date watch
        logged = False
        while True:
            held = self._read()
            if held is None:
                if self._put(None):
                    return
                continue
            holder, etag, age = held
            now = time.monotonic()
            if etag != seen[0]:
                seen = (etag, now)
            lease = _lease_of(holder, self.lease)
            why = dead_because(holder, self.me)
            if why is None and (age if age is not None else now - seen[1]) > lease + _CLOCK_GRAIN:
                why = f"it stopped renewing it for longer than its lease of {lease:g} s"
            if why is not None:
                if self._put(etag):
                    _log.info("took over the save lock %s from %s: %s", self.url, describe(holder), why)
                    return
                continue
            if now >= deadline:
                raise self._busy(holder, age, lease)
            if not logged:
                logged = True
                _log.warning("waiting up to %g s for the save lock %s, held by %s (%s)", self.wait, self.url,
                             describe(holder), _age(age, lease))
            time.sleep(max(0.05, min(self.lease / 8, lease / 8, deadline - now)))

    def _read(self) -> tuple[dict[str, Any], str, float | None] | None:
        """(holder, ETag, seconds since its last write by the store's clock or None) of the lock object, or None."""
        try:
            r = self.client.get_object(Bucket=self.bucket, Key=self.key)
            data = r["Body"].read()
        except Exception as e:
            if is_missing(e):
                return None
            raise write_error(e, self.url, what="looking for a save lock") from e
        try:
            holder = json.loads(data)
        except ValueError:
            holder = None
        return (holder if isinstance(holder, dict) else {}), r.get("ETag", ""), _store_age(r)

    def _put(self, etag: str | None) -> bool:
        """Write this save's lock object where it is still version ``etag``; False where another save was first."""
        sent = time.monotonic()
        body = self._body()
        try:
            r = put_if(self.client, self.bucket, self.key, body, etag)
        except Exception as e:
            if is_precondition_failed(e):
                return False
            raise write_error(e, self.url, what="taking the save lock") from e
        # A store without conditional writes takes both PUTs unconditionally: read back whose lock it is.
        try:
            back = self.client.get_object(Bucket=self.bucket, Key=self.key)["Body"].read()
        except Exception as e:
            if is_missing(e):
                return False
            raise write_error(e, self.url, what="reading the save lock back") from e
        if back != body:
            return False
        self.etag, self._valid_until = r.get("ETag"), sent + self.lease
        return True

    def _busy(self, holder: dict[str, Any], age: float | None, lease: float) -> CheckpointWriteError:
        return CheckpointWriteError(
            f"another save or conversion holds this location's lock ({LOCK_NAME}: {describe(holder)}, "
            f"{_age(age, lease)}) and it did not end within lock_wait={self.wait:g} s; try again when it has "
            f"finished, or raise lock_wait. A lock whose save stopped renewing it expires after its lease", path=self.url)

    # ------------------------------------------------------------------ holding
    def _renew(self) -> None:
        while not self._stop.wait(self.lease / 4):
            with self._mutex:
                if self._stop.is_set() or self.lost:
                    return
                sent = time.monotonic()
                self._renewals += 1
                try:
                    r = put_if(self.client, self.bucket, self.key, self._body(), self.etag)
                except Exception as e:
                    if is_precondition_failed(e) or is_missing(e):
                        self.lost = True
                        return
                    continue  # a transient failure: the next renewal tries again, within the lease
                self.etag, self._valid_until = r.get("ETag", self.etag), sent + self.lease

    def check(self, what: str = "commit") -> None:
        with self._mutex:
            if not self.lost and time.monotonic() >= self._valid_until:
                self.lost = True  # a contender may take it over from now on: never commit on it
            if not self.lost:
                try:
                    now = self.client.head_object(Bucket=self.bucket, Key=self.key).get("ETag")
                except Exception as e:
                    if not is_missing(e):
                        raise write_error(e, self.url, what=f"checking the save lock before the {what}") from e
                    now = None
                self.lost = now != self.etag
            if self.lost:
                raise CheckpointWriteError(
                    f"this save lost its lock before its {what}: it stalled for longer than its lease of "
                    f"{self.lease:g} s (lock_lease), and another save may have taken the location over; it did not "
                    "commit, and the checkpoint is as that other save left it. Save again", path=self.url)

    def holds(self) -> bool:
        """Whether :meth:`check` passes now (for what may be skipped rather than fail: removing leftovers)."""
        try:
            self.check("removal")
        except CheckpointWriteError:
            return False
        return True

    def release(self) -> None:
        self.released = True
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join()
            self._renewer = None
        with self._mutex:
            etag, self.etag = self.etag, None
            if etag is None or self.lost:
                return
            try:  # delete only our own: read and compare, then a DELETE conditional where the store honours it
                if self.client.head_object(Bucket=self.bucket, Key=self.key).get("ETag") == etag:
                    self.client.delete_object(Bucket=self.bucket, Key=self.key, IfMatch=etag)
            except Exception:
                pass  # left behind, it expires after its lease (or at once for a restart of this job)


def _lease_of(holder: dict[str, Any], own: float) -> float:
    lease = holder.get("lease")
    if isinstance(lease, (int, float)) and not isinstance(lease, bool) and 0 < lease < 1e6:
        return float(lease)
    return max(own, LEGACY_LEASE)  # a body that names no lease: an older mmapckpt's, or not a lock of ours


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


def _age(age: float | None, lease: float) -> str:
    return (f"renewed {age:.0f} s ago" if age is not None else "no store clock") + f", lease {lease:g} s"
