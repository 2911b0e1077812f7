"""Leases: a load in progress keeps its step from retention, on every medium.

A load through the manager first writes a lease ``ROOT/.leases/step-{N}.{id}.lease`` (JSON: the
step, the time it expires, its length, and who holds it: host, boot id, PID namespace, pid and
process start time, ``storage/holders.py``), then checks that the step is still committed, and
only then reads it. A thread renews the lease every quarter of its length while the load runs;
the lease is removed when the load ends.

Retention (``retention.py``) removes a step's ``.metadata`` first and reads the leases after
that. Either the reader's check comes before the removal (then its lease was written before it,
so retention sees the lease, puts the ``.metadata`` back and removes nothing) or after it (then
the reader finds no commit and does not read). Writes and listings are strongly consistent on a
local file system and on S3, which is what this needs.

A lease is live until ``expires`` plus one more lease by the retention's own clock (the margin
is for the clocks of the two machines, which must agree to within one lease), unless its holder
ran on this machine and is certainly dead (``holders.dead_because``): a killed loader's lease
is ignored at once there, and elsewhere once it has not been renewed for two leases.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
import uuid
from typing import Any

from ..errors import CheckpointError, CheckpointNotFoundError, CheckpointWriteError
from ..format.metadata import METADATA_NAME
from ..storage.holders import dead_because, this_process
from .root import LEASES, Root, step_dir

__all__ = ["Lease", "live_leases", "lease_committed", "recommitted", "DEFAULT_LEASE"]

#: seconds a lease lasts without renewal (renewed every quarter of it)
DEFAULT_LEASE = 30.0
_NAME = re.compile(r"step-(0|[1-9][0-9]*)\.[0-9a-f]{16}\.lease\Z")
_log = logging.getLogger("mmapckpt")


class Lease:
    """A held lease on step ``step`` of ``root``, renewed by a thread until :meth:`release`."""

    def __init__(self, root: Root, step: int, seconds: float = DEFAULT_LEASE) -> None:
        self.root, self.step, self.seconds = root, step, float(seconds)
        self.name = f"step-{step}.{uuid.uuid4().hex[:16]}.lease"
        self._holder = this_process(None, self.seconds)
        self._stop = threading.Event()
        storage = root.storage(LEASES)
        try:
            storage.prepare()
            self._write()
        except CheckpointError as e:
            raise CheckpointWriteError(f"cannot write the lease that keeps step {step} from retention while it "
                                       f"loads ({e}); a load through the manager needs write access to "
                                       f"{root.join(LEASES)} (mmapckpt.open(manager.path(step)) reads without "
                                       "one)", path=root.join(f"{LEASES}/{self.name}")) from e
        self._thread = threading.Thread(target=self._renew, name=f"mmapckpt-lease-{step}", daemon=True)
        self._thread.start()

    def _write(self) -> None:
        body = {"step": self.step, "expires": time.time() + self.seconds, "lease": self.seconds,
                "holder": self._holder}
        self.root.storage(LEASES).commit(self.name, json.dumps(body).encode(), sync=False)

    def _renew(self) -> None:
        while not self._stop.wait(self.seconds / 4):
            try:
                self._write()
            except Exception as e:  # the next renewal tries again; the lease runs out only after a whole lease
                _log.warning("mmapckpt: renewing the lease on step %s failed: %s", self.step, e)

    def release(self) -> None:
        """Stop renewing and remove the lease."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join()
        try:
            self.root.storage(LEASES).remove([self.name], sync=False)
        except Exception as e:  # it expires by itself; retention removes it then
            _log.warning("mmapckpt: removing the lease on step %s failed: %s", self.step, e)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def live_leases(root: Root, *, tidy: bool = False) -> set[int]:
    """The steps some live lease holds. ``tidy``: remove the leases that are no longer live."""
    storage = root.storage(LEASES)
    names = [n for n in storage.list() if _NAME.match(n)]
    me, now = this_process(None, 0.0), time.time()
    live: set[int] = set()
    dead: list[str] = []
    for name in names:
        try:
            doc: Any = json.loads(bytes(storage.read_file(name, 1 << 16)).decode())
            step, expires, seconds = int(doc["step"]), float(doc["expires"]), float(doc["lease"])
            holder = doc.get("holder") or {}
        except CheckpointError:
            continue  # removed meanwhile (its load ended)
        except (ValueError, KeyError, TypeError, UnicodeDecodeError):
            dead.append(name)  # not a lease this package wrote (a lease is committed whole)
            continue
        if now > expires + seconds or dead_because(holder, me) is not None:
            dead.append(name)
        else:
            live.add(step)
    if tidy and dead:
        storage.remove(dead, sync=False)
    return live


#: a load of the latest step chooses again this many times when retention drops its choice meanwhile
_CHOICES = 5


def lease_committed(root: Root, step: int | None, seconds: float) -> Lease:
    """A lease on committed step ``step`` (the newest where None), taken before its commit is checked (see above).

    Raises:
        CheckpointNotFoundError: no such committed step (naming it and the committed ones), or none at all.
    """
    for _ in range(_CHOICES):
        s = step if step is not None else _newest(root)
        if s is None:
            raise CheckpointNotFoundError("no committed step under this root yet", path=root.location)
        lease = Lease(root, s, seconds)
        if root.step_storage(s).exists(METADATA_NAME):
            return lease
        lease.release()
        if step is not None:
            committed = sorted(n for n, c in root.step_dirs().items() if c)
            listed = ", ".join(map(str, committed[-10:])) if committed else "none"
            raise CheckpointNotFoundError(f"no committed step {s} under this root (committed: {listed})",
                                          path=root.join(step_dir(s)))
    raise CheckpointNotFoundError(f"the newest step was dropped {_CHOICES} times while a load chose it: is another "
                                  "job saving into this root with keep_last=1?", path=root.location)


def _newest(root: Root) -> int | None:
    committed = [s for s, c in root.step_dirs().items() if c]
    return max(committed) if committed else None


def recommitted(root: Root, step: int, seconds: float) -> int:
    """Step ``step``, once its ``.metadata`` is back: a load that holds a lease on it found it removed by a retention
    that saw the lease at its second look and puts it back at once. Waits up to ``seconds``.

    Raises:
        CheckpointNotFoundError: it did not come back (the retention was killed in between: the step is gone).
    """
    deadline = time.monotonic() + seconds
    while not root.step_storage(step).exists(METADATA_NAME):
        if time.monotonic() > deadline:
            raise CheckpointNotFoundError(f"step {step} lost its commit while it was being loaded and did not get it "
                                          "back (a retention was killed meanwhile): load another step",
                                          path=root.join(step_dir(step)))
        time.sleep(0.05)
    return step
