"""Who holds a leased save lock, and whether a contender can tell that holder is dead.

A lease lock (an object store's lock object; ``leased_lock.py``) outlives a killed holder until its
lease runs out, unlike a ``flock``. A job restarted after ``kill -9`` or a preemption should not
wait for that, so the lock records its holder (:func:`this_process`) and a contender takes it
over at once where it can *tell* the holder is dead (:func:`dead_because`), and only then:

- **same machine, process gone**: the holder ran on this kernel (same host name, same boot id)
  in this PID namespace, and its pid is gone, is a zombie, or is another process now (its start
  time in ``/proc/PID/stat`` differs: the pid was reused). Every field must match: two
  containers on one host share the boot id but not the PID namespace, and a pid of another
  namespace says nothing here.
- **the same job restarting**: the holder and the contender carry the same job identity (the
  ``lock_job`` storage option, else ``TORCHELASTIC_RUN_ID``, else ``SLURM_JOB_ID`` with
  ``SLURM_ARRAY_TASK_ID``) and are different processes. A scheduler stops every process of a job
  before it restarts it (torchelastic's agent stops its workers before the next rendezvous;
  Slurm ends a job before it requeues it), and within one run of a job only one process saves to
  a location (the coordinator of a collective save; a per-rank save takes no lock), so another
  process of the same job holding the lock is one of a run that has ended. A caller who gives
  ``lock_job`` promises the same. Even where that promise is broken, commits stay fenced (the
  robbed save's commit is refused, ``leased_lock.py``): a wrong takeover costs a save, not a checkpoint.

Anything else (another host, unreadable ``/proc``, a body without these fields) is judged by
the holder's lease alone.
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Mapping
from typing import Any

__all__ = ["this_process", "job_identity", "dead_because", "describe"]

_WHERE = ("host", "boot", "pidns")


def job_identity(given: str | None) -> str | None:
    """The job this process belongs to: ``given`` (the ``lock_job`` option; ``""`` means none), else the scheduler's."""
    if given is not None:
        return given or None
    run = os.environ.get("TORCHELASTIC_RUN_ID")
    if run:
        return f"torchelastic:{run}"
    job = os.environ.get("SLURM_JOB_ID")
    if job:
        task = os.environ.get("SLURM_ARRAY_TASK_ID")
        return f"slurm:{job}" + (f"_{task}" if task else "")
    return None


def this_process(job: str | None, lease: float) -> dict[str, Any]:
    """What a lock object records of its holder: a random owner id, where and which process, its lease, its job."""
    pid = os.getpid()
    return {"owner": uuid.uuid4().hex, "host": socket.gethostname(), "boot": _boot_id(), "pidns": _pidns(),
            "pid": pid, "start": _start_time(pid), "lease": lease, "job": job}


def dead_because(holder: Mapping[str, Any], me: Mapping[str, Any]) -> str | None:
    """Why the lock's ``holder`` is certainly dead, seen from ``me`` (:func:`this_process`), or None where it may live."""
    if not isinstance(holder.get("pid"), int):
        return None
    same_process = all(holder.get(k) == me.get(k) for k in _WHERE) and holder["pid"] == me["pid"]
    if holder.get("job") and holder.get("job") == me.get("job") and not same_process:
        return f"it is an earlier run of this job ({holder['job']})"
    if not all(me.get(k) is not None and holder.get(k) == me.get(k) for k in _WHERE):
        return None  # another machine or PID namespace: its pid says nothing here
    pid = holder["pid"]
    state = _stat(pid)
    if state is None:
        return f"its process (pid {pid}) is gone"
    if state[0] in ("Z", "X"):
        return f"its process (pid {pid}) has exited"
    if holder.get("start") is not None and state[1] != holder["start"]:
        return f"its process (pid {pid}) is gone (the pid is another process's now)"
    return None


def describe(holder: Mapping[str, Any]) -> str:
    """The holder, for messages: ``host myhost, pid 1234, job slurm:77``."""
    parts = [f"host {holder.get('host', '?')}", f"pid {holder.get('pid', '?')}"]
    if holder.get("job"):
        parts.append(f"job {holder['job']}")
    return ", ".join(parts)


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _boot_id() -> str | None:
    return _read("/proc/sys/kernel/random/boot_id")


def _pidns() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, start time in clock ticks since boot) of process ``pid``, or None where there is none."""
    text = _read(f"/proc/{pid}/stat")
    if not text:
        return None
    fields = text.rpartition(")")[2].split()  # the command name, in parentheses, may hold spaces
    try:
        return fields[0], int(fields[19])
    except (IndexError, ValueError):
        return None


def _start_time(pid: int) -> int | None:
    state = _stat(pid)
    return None if state is None else state[1]
