"""The save lock of an object-store prefix, whatever the store: a leased lock object, taken and renewed with
conditional writes. Each store gives only its primitives (``s3/lock.py``, ``gcs/lock.py``, ``azure/lock.py``).

An object store has no directory to ``flock``. A save takes the lock by creating the object
``PREFIX/.mmapckpt-lock`` only where there is none (S3 ``If-None-Match: *``, GCS ``ifGenerationMatch=0``)
and renews it every quarter lease by rewriting it only while it is still the version it wrote last (S3
``If-Match`` its ETag, GCS ``ifGenerationMatch`` its generation; each renewal's body differs, so its
version changes). The object records its holder: a random owner id, host, boot id, PID namespace, pid and
process start time, its job, and its lease (``storage/holders.py``).

A contender that finds the lock held takes it over (again conditionally, on the version it found, so two
contenders cannot both take one lock):

- at once where it can tell the holder is dead (its process gone on this machine, or an earlier run of
  the same job: ``holders.dead_because``);
- once the holder stopped renewing for longer than *the holder's* lease (plus the store clock's
  one-second granularity), by the store's clock where the store tells the object's age; otherwise once
  the object's version stayed the same for that long on the contender's own monotonic clock;
- otherwise it waits, up to ``lock_wait`` seconds, logging once whom it waits for, and then raises
  CheckpointWriteError.

**Fencing.** A holder that stalls (a GC pause, a stopped container) past its lease can lose the lock
while it still means to commit. :meth:`LeasedLock.check` proves the lock is still held just before a
commit: not lost at a renewal, its last renewal less than a lease ago on this process's monotonic clock,
and the lock object still its own version (Azure: its lease renewed). The commit itself is then
conditional on the version of the committed object that the save saw when it took the lock
(``storage/object_store.py``), which closes the window between the check and the write. :meth:`release`
deletes the object only while it is still its own.

Where a store ignores the conditions, the lock is advisory: after writing its own a save reads it back
and refuses if another save's body is there, and the check before the commit remains
(docs/object-storage.md). A per-rank save (``use_collectives=False``, ``shared=True``) takes no lock: its
ranks write disjoint files.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any

from ..errors import CheckpointWriteError
from .base import Lock
from .failures import StoreFailures
from .holders import dead_because, describe, this_process

__all__ = ["LeasedLock", "NoLock", "LOCK_NAME", "LEGACY_LEASE", "lease_of"]

#: The lock object's name under the prefix (not a DCP file name: nothing removes it but its owner, or a save
#: taking over a stale one; never listed as a file of the checkpoint).
LOCK_NAME = ".mmapckpt-lock"
#: The lease of a lock object that names none (an older mmapckpt's, whose default lease this was).
LEGACY_LEASE = 120.0
#: The store's clocks count whole seconds: a lock is stale only this much after its holder's lease.
CLOCK_GRAIN = 1.0

_log = logging.getLogger("mmapckpt")


class LeasedLock(Lock):
    """The exclusive lock of one prefix, held from :meth:`_hold` until :meth:`release` (see the module).

    A store's lock gives :meth:`_read`, :meth:`_write`, :meth:`_version_now`, :meth:`_delete` and its
    ``failures`` (which errors mean "refused" and "no such object", and its ``write_error``); it calls
    :meth:`_hold` at the end of its ``__init__``.

    Attributes:
        lease: seconds the lock lives without renewal (renewed every quarter of it).
        wait: seconds a contender waits for a live holder before it raises.
        lost: set when a renewal or :meth:`check` found the lock taken over.
        version: what this save holds: the lock object's version it wrote last (Azure: its lease).
    """

    #: the renewal thread's name
    thread_name = "mmapckpt-lock"
    #: how the store's errors read (its ``failures.py``)
    failures: StoreFailures

    def __init__(self, url: str, *, lease: float, wait: float, job: str | None) -> None:
        self.url, self.lease, self.wait = url, lease, wait
        self.me = this_process(job, lease)
        self.version: Any = None
        self.lost = False
        self.released = False
        self._renewals = 0
        self._valid_until = 0.0  # monotonic: the last write of the lock object sent + the lease
        self._mutex = threading.Lock()  # a renewal and a check (or release) never overlap
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    def _hold(self) -> None:
        """Take the lock (waiting, taking over a dead holder's) and start renewing it."""
        self._take()
        self._taken()
        self._renewer = threading.Thread(target=self._renew, name=self.thread_name, daemon=True)
        self._renewer.start()

    # ------------------------------------------------------------------ a store's primitives
    def _read(self) -> tuple[dict[str, Any], Any, float | None] | None:
        """(holder, version, age by the store's clock or None) of the lock object, None where there is none;
        the store's own errors raised."""
        raise NotImplementedError

    def _write(self, body: bytes, version: Any) -> Any:
        """Write ``body`` where the lock object is still ``version`` (None: where there is none); its new version,
        or None where the store's answer tells none. A refused condition raises the store's error."""
        raise NotImplementedError

    def _version_now(self) -> Any:
        """The lock object's version now (a missing object raises the store's error)."""
        raise NotImplementedError

    def _delete(self, version: Any) -> None:
        """Delete the lock object where it is still ``version`` (errors raised; :meth:`release` ignores them)."""
        raise NotImplementedError

    def _refused(self, e: BaseException) -> bool:
        return self.failures.refused(e)

    def _missing(self, e: BaseException) -> bool:
        return self.failures.missing(e)

    def _error(self, e: BaseException, what: str) -> Exception:
        """The store's error ``e`` as a CheckpointWriteError about this lock."""
        return self.failures.write_error(e, self.url, what=what)

    def _taken(self) -> None:
        """What a store checks once the lock is taken (GCS: that it honours preconditions at all)."""

    # ------------------------------------------------------------------ taking
    def _body(self) -> bytes:
        return json.dumps({**self.me, "renewed": self._renewals}).encode()

    def _take(self) -> None:
        deadline = time.monotonic() + self.wait
        seen: tuple[Any, float] = (None, 0.0)  # (version, when first seen): the watch where the store has no clock
        logged = False
        while True:
            held = self._look()
            if held is None:
                if self._put(None):
                    return
                continue
            holder, version, age = held
            now = time.monotonic()
            if version != seen[0]:
                seen = (version, now)
            lease = lease_of(holder, self.lease)
            why = dead_because(holder, self.me)
            if why is None and (age if age is not None else now - seen[1]) > lease + CLOCK_GRAIN:
                why = f"it stopped renewing it for longer than its lease of {lease:g} s"
            if why is not None:
                if self._put(version):
                    _log.info("took over the save lock %s from %s: %s", self.url, describe(holder), why)
                    return
                continue
            if now >= deadline:
                raise _busy(self, holder, _age(age, lease))
            if not logged:
                logged = True
                _log.warning("waiting up to %g s for the save lock %s, held by %s (%s)", self.wait, self.url,
                             describe(holder), _age(age, lease))
            time.sleep(max(0.05, min(self.lease / 8, lease / 8, deadline - now)))

    def _look(self, what: str = "looking for a save lock") -> tuple[dict[str, Any], Any, float | None] | None:
        try:
            return self._read()
        except Exception as e:
            if self._missing(e):
                return None
            raise self._error(e, what) from e

    def _put(self, version: Any) -> bool:
        """Write this save's lock object where it is still ``version``; False where another save was first."""
        sent = time.monotonic()
        body = self._body()
        try:
            written = self._write(body, version)
        except Exception as e:
            if self._refused(e):
                return False
            raise self._error(e, "taking the save lock") from e
        # A store without conditional writes takes both writes unconditionally: read back whose lock it is.
        back = self._look("reading the save lock back")
        if back is None or back[0] != json.loads(body):
            return False
        self.version = written if written is not None else back[1]
        self._valid_until = sent + self.lease
        return True

    # ------------------------------------------------------------------ holding
    def _renew_once(self) -> None:
        """Rewrite the lock object on its own version (a refused or missing object: the lock is lost)."""
        sent = time.monotonic()
        self._renewals += 1
        written = self._write(self._body(), self.version)
        self.version = written if written is not None else self.version
        self._valid_until = sent + self.lease

    def _still_ours(self) -> bool:
        """Whether the lock object is still the version this save wrote last (asked of the store)."""
        return bool(self._version_now() == self.version)

    def _renew(self) -> None:
        while not self._stop.wait(self.lease / 4):
            with self._mutex:
                if self._stop.is_set() or self.lost:
                    return
                try:
                    self._renew_once()
                except Exception as e:
                    if self._refused(e) or self._missing(e):
                        self.lost = True
                        return
                    # a transient failure: the next renewal tries again, within the lease

    def _lost_because(self) -> str:
        return f"it stalled for longer than its lease of {self.lease:g} s (lock_lease)"

    def check(self, what: str = "commit") -> None:
        with self._mutex:
            if not self.lost and time.monotonic() >= self._valid_until:
                self.lost = True  # a contender may take it over from now on: never commit on it
            if not self.lost:
                try:
                    self.lost = not self._still_ours()
                except Exception as e:
                    if not (self._refused(e) or self._missing(e)):
                        raise self._error(e, f"checking the save lock before the {what}") from e
                    self.lost = True
            if self.lost:
                raise CheckpointWriteError(
                    f"this save lost its lock before its {what}: {self._lost_because()}, and another save may have "
                    "taken the location over; it did not commit, and the checkpoint is as that other save left it. "
                    "Save again", path=self.url)

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
        renewer, self._renewer = self._renewer, None
        if renewer is not None and renewer is not threading.current_thread():
            renewer.join()
        with self._mutex:
            version, self.version = self.version, None
            if version is None or self.lost:
                return
            try:  # delete only our own
                self._delete(version)
            except Exception as e:  # left behind, it expires after its lease (or at once for a restart of this job)
                _log.debug("releasing the save lock %s: %s", self.url, e)


class NoLock(Lock):
    """The lock of a per-rank save on an object store: none (its ranks write disjoint objects)."""

    def release(self) -> None:
        pass


def lease_of(holder: dict[str, Any], own: float) -> float:
    """The lease the lock object's ``holder`` gives itself (a body that names none: an older mmapckpt's)."""
    lease = holder.get("lease")
    if isinstance(lease, (int, float)) and not isinstance(lease, bool) and 0 < lease < 1e6:
        return float(lease)
    return max(own, LEGACY_LEASE)


def _busy(lock: LeasedLock, holder: dict[str, Any], state: str) -> CheckpointWriteError:
    return CheckpointWriteError(
        f"another save or conversion holds this location's lock ({LOCK_NAME}: {describe(holder)}, {state}) and it "
        f"did not end within lock_wait={lock.wait:g} s; try again when it has finished, or raise lock_wait. A lock "
        "whose save stopped renewing it expires after its lease", path=lock.url)


def _age(age: float | None, lease: float) -> str:
    return (f"renewed {age:.0f} s ago" if age is not None else "no store clock") + f", lease {lease:g} s"
