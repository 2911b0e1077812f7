"""The save lock of a ``gs://`` prefix: the store's primitives of the leased lock (``storage/leased_lock.py``).

GCS has no leases; every write can be made conditional on the object's generation. The lock object is
created with ``ifGenerationMatch=0`` (refused with 412 where it exists) and renewed with
``ifGenerationMatch`` its own generation. GCS's answers tell no object age, so a contender watches the
generation on its own monotonic clock.

**A store that ignores preconditions** (gcp-storage-emulator does) would let two saves both "create"
the lock. After taking it, the lock probes once: creating the object again with ``ifGenerationMatch=0``
must be refused. Where it is not, the lock raises CheckpointWriteError, or, with
``require_preconditions=False``, warns that the lock is advisory and goes on (read back: a save whose
body is not the one there does not hold it).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from ...errors import CheckpointWriteError
from ..leased_lock import LOCK_NAME, LeasedLock
from .failures import FAILURES, is_precondition_failed, write_error

__all__ = ["GenerationLock", "LOCK_NAME"]

_log = logging.getLogger("mmapckpt")
_warned: set[str] = set()


class GenerationLock(LeasedLock):
    """The exclusive lock of one prefix, held from :meth:`__init__` until :meth:`release` (``LeasedLock``)."""

    thread_name = "mmapckpt-gs-lock"
    failures = FAILURES

    def __init__(self, bucket: Any, key: str, url: str, *, lease: float, wait: float, job: str | None,
                 require_preconditions: bool) -> None:
        super().__init__(url, lease=lease, wait=wait, job=job)
        self.bucket, self.key, self.require_preconditions = bucket, key, require_preconditions
        self._hold()

    def _read(self) -> tuple[dict[str, Any], Any, float | None] | None:
        blob = self.bucket.blob(self.key)
        data = blob.download_as_bytes()
        try:
            holder = json.loads(data)
        except ValueError:
            holder = None
        return (holder if isinstance(holder, dict) else {}), int(blob.generation or 0), None

    def _write(self, body: bytes, version: Any) -> Any:
        blob = self.bucket.blob(self.key)
        blob.upload_from_string(body, if_generation_match=version or 0)
        return int(blob.generation or 0) or None

    def _version_now(self) -> Any:
        blob = self.bucket.blob(self.key)
        blob.reload()
        return int(blob.generation or 0)

    def _delete(self, version: Any) -> None:
        self.bucket.blob(self.key).delete(if_generation_match=version)

    def _taken(self) -> None:
        """Refuse (or, not required, warn once) where the store ignores ``ifGenerationMatch=0`` on an existing
        object."""
        try:
            r = self.bucket.blob(self.key)
            r.upload_from_string(self._body(), if_generation_match=0)
        except Exception as e:
            if is_precondition_failed(e):
                return
            self.release()
            raise write_error(e, self.url, what="checking the store's preconditions") from e
        self.version = int(r.generation or 0)  # it rewrote the object: our generation is the new one
        if self.require_preconditions:
            self.release()
            raise CheckpointWriteError(
                "this store ignores generation preconditions (ifGenerationMatch), so no save lock and no fenced "
                "commit can be had on it (GCS honours them; some emulators do not). Pass "
                "storage_options require_preconditions=False to save with an advisory lock", path=self.url)
        if self.url.split("/")[2] not in _warned:
            _warned.add(self.url.split("/")[2])
            _log.warning("gs:// store at %s ignores generation preconditions: the save lock is advisory and commits "
                         "are not fenced (require_preconditions=False)", self.url)
