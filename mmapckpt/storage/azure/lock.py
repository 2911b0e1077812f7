"""The save lock of an ``az://`` prefix: an Azure blob lease on ``PREFIX/.mmapckpt-lock``.

Azure enforces a lease on the service: while one is active, no other client can take it, and
the blob cannot be written without the lease id. A lease lives 15 to 60 s (``lock_lease``,
clamped) unless renewed; this lock renews it every quarter lease, so a holder that dies
releases the lock within one lease, by the service's own clock.

The blob's body names its holder (``storage/holders.py``), so that a contender can take over at
once from a holder it can tell is dead (this machine's process gone, or an earlier run of the
same job) by breaking the lease. The holder writes its body *before* it takes the lease, so the
body a contender reads under an active lease is always the lease holder's:

1. read the blob's properties; where a lease is active, read its body (conditional on the ETag
   just seen) and either wait, or break the lease (conditional on that ETag) where the holder is
   dead, and start again;
2. where no lease is active: write this save's body, conditional on the ETag seen (or on there
   being no blob); another contender's write in between makes it fail, and the loop starts again;
3. acquire the lease, conditional on the ETag of the body just written: only the save whose body
   is there can take it.

**Fencing.** :meth:`BlobLeaseLock.check` renews the lease just before a commit: the service says
then whether this save still holds it (a broken or expired lease, or one another save has taken
since, fails the renewal). The commit is then conditional on the version of ``.metadata`` the save
saw when it took the lock (``If-Match``, or ``If-None-Match: *``), which closes the window
between the renewal and the write.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from ...errors import CheckpointWriteError
from ..holders import dead_because, describe
from ..leased_lock import LOCK_NAME, LeasedLock
from .failures import FAILURES, is_conflict, is_missing, write_error

__all__ = ["BlobLeaseLock", "LOCK_NAME"]

_log = logging.getLogger("mmapckpt")


class BlobLeaseLock(LeasedLock):
    """The exclusive lock of one prefix, held from :meth:`__init__` until :meth:`release` (see the module); its
    holding (renewal, check, release) is ``LeasedLock``'s, over the lease (``version`` is the lease client).

    Attributes:
        lease: seconds of the lease (15 to 60), renewed every quarter of it.
    """

    thread_name = "mmapckpt-az-lock"
    failures = FAILURES

    def __init__(self, blob: Any, url: str, *, lease: int, wait: float, job: str | None) -> None:
        super().__init__(url, lease=float(lease), wait=wait, job=job)
        self.blob, self.lease = blob, lease
        self._hold()

    # ------------------------------------------------------------------ taking
    def _take(self) -> None:
        from azure.core import MatchConditions
        deadline = time.monotonic() + self.wait
        logged = False
        body = json.dumps(self.me).encode()
        while True:
            try:
                props = self.blob.get_blob_properties()
            except Exception as e:
                if not is_missing(e):
                    raise write_error(e, self.url, what="looking for a save lock") from e
                props = None
            if props is not None and props.lease.state == "leased":
                holder = self._holder(props.etag)
                if holder is None:
                    continue  # rewritten meanwhile: look again
                why = dead_because(holder, self.me)
                if why is not None:
                    if self._break(props.etag):
                        _log.info("broke the save lock %s of %s: %s", self.url, describe(holder), why)
                    continue
                now = time.monotonic()
                if now >= deadline:
                    raise CheckpointWriteError(
                        f"another save or conversion holds this location's lock ({LOCK_NAME}: {describe(holder)}, "
                        f"an Azure lease) and it did not end within lock_wait={self.wait:g} s; try again when it has "
                        "finished, or raise lock_wait. A lease whose save stopped renewing it expires within "
                        "60 s", path=self.url)
                if not logged:
                    logged = True
                    _log.warning("waiting up to %g s for the save lock %s, held by %s", self.wait, self.url,
                                 describe(holder))
                time.sleep(max(0.05, min(self.lease / 8, deadline - now)))
                continue
            try:  # 2: this save's body, where no other contender wrote meanwhile
                if props is None:
                    r = self.blob.upload_blob(body, overwrite=False)
                else:
                    r = self.blob.upload_blob(body, overwrite=True, etag=props.etag,
                                              match_condition=MatchConditions.IfNotModified)
                sent = time.monotonic()  # 3: the lease, on that body only
                lease_client = self.blob.acquire_lease(self.lease, etag=r["etag"],
                                                      match_condition=MatchConditions.IfNotModified)
            except Exception as e:
                if is_conflict(e) or is_missing(e):  # another contender was first (or a lease is breaking)
                    if time.monotonic() >= deadline + 60:  # past any lease or break period: give up, saying so
                        raise CheckpointWriteError(
                            f"could not take this location's lock ({LOCK_NAME}): other saves kept taking it or its "
                            f"lease kept breaking for lock_wait={self.wait:g} s and a minute more; try again",
                            path=self.url) from None
                    time.sleep(0.05)
                    continue
                raise write_error(e, self.url, what="taking the save lock") from e
            self.version, self._valid_until = lease_client, sent + self.lease
            return

    def _holder(self, etag: str) -> dict[str, Any] | None:
        """The holder the lock blob of version ``etag`` names ({} for a body that is not one), None if it changed."""
        from azure.core import MatchConditions
        try:
            data = self.blob.download_blob(etag=etag, match_condition=MatchConditions.IfNotModified).readall()
        except Exception as e:
            if is_conflict(e) or is_missing(e):
                return None
            raise write_error(e, self.url, what="reading the save lock") from e
        try:
            holder = json.loads(data)
        except ValueError:
            holder = {}
        return holder if isinstance(holder, dict) else {}

    def _break(self, etag: str) -> bool:
        from azure.core import MatchConditions
        from azure.storage.blob import BlobLeaseClient
        try:
            BlobLeaseClient(self.blob).break_lease(lease_break_period=0, etag=etag,
                                                   match_condition=MatchConditions.IfNotModified)
        except Exception as e:
            if is_conflict(e) or is_missing(e):
                return False
            raise write_error(e, self.url, what="taking over a dead save's lock") from e
        return True

    # ------------------------------------------------------------------ holding: the lease
    def _renew_once(self) -> None:
        """Renew the lease (the service refuses where it is broken, expired and retaken, or released)."""
        sent = time.monotonic()
        self.version.renew()
        self._valid_until = sent + self.lease

    def _still_ours(self) -> bool:
        self._renew_once()  # the service says whether this save still holds the lease
        return True

    def _delete(self, version: Any) -> None:
        try:  # delete it under the lease (only the holder can), as S3's lock object is removed
            self.blob.delete_blob(lease=version)
        except Exception:
            version.release()

    def _lost_because(self) -> str:
        return f"its lease of {self.lease} s (lock_lease) ran out or was broken"
