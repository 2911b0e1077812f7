"""The save lock of a ``gs://`` prefix: a lock object taken and renewed with generation preconditions.

GCS has no leases; every write can be made conditional on the object's generation. A save takes
the lock by creating ``PREFIX/.mmapckpt-lock`` with ``ifGenerationMatch=0`` (refused with 412 where
it exists) and renews it every quarter lease by rewriting it with ``ifGenerationMatch`` its own
generation. Its body names its holder (``storage/holders.py``). A contender that finds it held takes
it over, conditionally on the generation it found (so two contenders cannot both take it):

- at once where it can tell the holder is dead (this machine's process gone, an earlier run of the
  same job);
- once the object kept the same generation for longer than the holder's lease on the contender's
  own monotonic clock (no renewal seen);
- otherwise it waits up to ``lock_wait`` seconds and raises CheckpointWriteError.

**Fencing**, as on S3: :meth:`GenerationLock.check` proves the lock still held just before a commit
(not lost at a renewal, renewed less than a lease ago, the object still at its generation), and the
commit itself is conditional on the generation of ``.metadata`` the save saw when it took the lock.

**A store that ignores preconditions** (gcp-storage-emulator does) would let two saves both "create"
the lock. After taking it, the lock probes once: creating the object again with ``ifGenerationMatch=0``
must be refused. Where it is not, the lock raises CheckpointWriteError, or, with
``require_preconditions=False``, warns that the lock is advisory and goes on (read back: a save whose
body is not the one there does not hold it).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any

from ...errors import CheckpointWriteError
from ..base import Lock
from ..holders import dead_because, describe, this_process
from .failures import is_missing, is_precondition_failed, write_error

__all__ = ["GenerationLock", "LOCK_NAME"]

LOCK_NAME = ".mmapckpt-lock"
_log = logging.getLogger("mmapckpt")
_warned: set[str] = set()


class GenerationLock(Lock):
    """The exclusive lock of one prefix, held from :meth:`__init__` until :meth:`release` (see the module)."""

    def __init__(self, bucket: Any, key: str, url: str, *, lease: float, wait: float, job: str | None,
                 require_preconditions: bool) -> None:
        self.bucket, self.key, self.url, self.lease, self.wait = bucket, key, url, lease, wait
        self.me = this_process(job, lease)
        self.generation: int | None = None
        self.lost = False
        self.released = False
        self._renewals = 0
        self._valid_until = 0.0
        self._mutex = threading.Lock()
        self._stop = threading.Event()
        self._take()
        self._probe(require_preconditions)
        self._renewer = threading.Thread(target=self._renew, name="mmapckpt-gs-lock", daemon=True)
        self._renewer.start()

    def _body(self) -> bytes:
        return json.dumps({**self.me, "renewed": self._renewals}).encode()

    def _take(self) -> None:
        deadline = time.monotonic() + self.wait
        seen: tuple[int | None, float] = (None, 0.0)
        logged = False
        while True:
            held = self._read()
            if held is None:
                if self._put(0):
                    return
                continue
            holder, generation = held
            now = time.monotonic()
            if generation != seen[0]:
                seen = (generation, now)
            lease = holder.get("lease") if isinstance(holder.get("lease"), (int, float)) else self.lease
            why = dead_because(holder, self.me)
            if why is None and now - seen[1] > float(lease) + 1.0:
                why = f"it stopped renewing it for longer than its lease of {lease:g} s"
            if why is not None:
                if self._put(generation):
                    _log.info("took over the save lock %s from %s: %s", self.url, describe(holder), why)
                    return
                continue
            if now >= deadline:
                raise CheckpointWriteError(
                    f"another save or conversion holds this location's lock ({LOCK_NAME}: {describe(holder)}) and "
                    f"it did not end within lock_wait={self.wait:g} s; try again when it has finished, or raise "
                    "lock_wait. A lock whose save stopped renewing it expires after its lease", path=self.url)
            if not logged:
                logged = True
                _log.warning("waiting up to %g s for the save lock %s, held by %s", self.wait, self.url,
                             describe(holder))
            time.sleep(max(0.05, min(self.lease / 8, deadline - now)))

    def _read(self) -> tuple[dict[str, Any], int] | None:
        blob = self.bucket.blob(self.key)
        try:
            data = blob.download_as_bytes()
        except Exception as e:
            if is_missing(e):
                return None
            raise write_error(e, self.url, what="looking for a save lock") from e
        try:
            holder = json.loads(data)
        except ValueError:
            holder = None
        return (holder if isinstance(holder, dict) else {}), int(blob.generation or 0)

    def _put(self, generation: int) -> bool:
        """Write this save's body where the object is still ``generation`` (0: absent); False where another was first."""
        sent = time.monotonic()
        body = self._body()
        blob = self.bucket.blob(self.key)
        try:
            blob.upload_from_string(body, if_generation_match=generation)
        except Exception as e:
            if is_precondition_failed(e):
                return False
            raise write_error(e, self.url, what="taking the save lock") from e
        back = self._read()  # a store without preconditions takes both writes: whose body is there?
        if back is None or back[0] != json.loads(body):
            return False
        self.generation, self._valid_until = back[1], sent + self.lease
        return True

    def _probe(self, required: bool) -> None:
        """Refuse (or, not required, warn once) where the store ignores ``ifGenerationMatch=0`` on an existing object."""
        try:
            r = self.bucket.blob(self.key)
            r.upload_from_string(self._body(), if_generation_match=0)
        except Exception as e:
            if is_precondition_failed(e):
                return
            self.release()
            raise write_error(e, self.url, what="checking the store's preconditions") from e
        self.generation = int(r.generation or 0)  # it rewrote the object: our generation is the new one
        if required:
            self.release()
            raise CheckpointWriteError(
                "this store ignores generation preconditions (ifGenerationMatch), so no save lock and no fenced "
                "commit can be had on it (GCS honours them; some emulators do not). Pass "
                "storage_options require_preconditions=False to save with an advisory lock", path=self.url)
        if self.url.split("/")[2] not in _warned:
            _warned.add(self.url.split("/")[2])
            _log.warning("gs:// store at %s ignores generation preconditions: the save lock is advisory and commits "
                         "are not fenced (require_preconditions=False)", self.url)

    def _renew(self) -> None:
        while not self._stop.wait(self.lease / 4):
            with self._mutex:
                if self._stop.is_set() or self.lost:
                    return
                sent = time.monotonic()
                self._renewals += 1
                blob = self.bucket.blob(self.key)
                try:
                    blob.upload_from_string(self._body(), if_generation_match=self.generation)
                except Exception as e:
                    if is_precondition_failed(e) or is_missing(e):
                        self.lost = True
                        return
                    continue
                self.generation, self._valid_until = int(blob.generation or 0), sent + self.lease

    def check(self, what: str = "commit") -> None:
        with self._mutex:
            if not self.lost and time.monotonic() >= self._valid_until:
                self.lost = True
            if not self.lost:
                blob = self.bucket.blob(self.key)
                try:
                    blob.reload()
                    now = int(blob.generation or 0)
                except Exception as e:
                    if not is_missing(e):
                        raise write_error(e, self.url, what=f"checking the save lock before the {what}") from e
                    now = None
                self.lost = now != self.generation
            if self.lost:
                raise CheckpointWriteError(
                    f"this save lost its lock before its {what}: it stalled for longer than its lease of "
                    f"{self.lease:g} s (lock_lease), and another save may have taken the location over; it did not "
                    "commit, and the checkpoint is as that other save left it. Save again", path=self.url)

    def holds(self) -> bool:
        try:
            self.check("removal")
        except CheckpointWriteError:
            return False
        return True

    def release(self) -> None:
        self.released = True
        self._stop.set()
        renewer = getattr(self, "_renewer", None)
        if renewer is not None and renewer is not threading.current_thread():
            renewer.join()
        with self._mutex:
            generation, self.generation = self.generation, None
            if generation is None or self.lost:
                return
            try:  # delete only our own generation
                self.bucket.blob(self.key).delete(if_generation_match=generation)
            except Exception:
                pass  # left behind, it expires after its lease
