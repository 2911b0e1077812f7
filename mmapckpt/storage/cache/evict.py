"""The cache's size bound: least recently used copies removed, never one a process has open or mapped.

After each fetch the entries' sizes are summed (their copies and any leftovers of killed fetches);
above ``max_bytes`` the entries are removed in order of last use (the mtime of ``#record``, touched
at every open) until the sum fits, skipping the entry just fetched, an entry whose ``#lock`` is
held (a fetch in progress) and an entry whose copy cannot be locked exclusively at once (a process
has it open or mapped: its shared lock lives as long as its mapping). So the bound can be exceeded
while the copies over it are in use, and one file larger than the bound is still cached, alone.
"""

from __future__ import annotations

import fcntl
import os

from ...io.files import unlink_quietly
from .entry import LOCK, RECORD

__all__ = ["evict"]


def _entries(root: str) -> list[tuple[float, str, int]]:
    """(last use, directory, bytes) of every entry under ``root``."""
    out = []
    for top in _listdir(root):
        for key in _listdir(os.path.join(root, top)):
            d = os.path.join(root, top, key)
            size, used = 0, None
            for n in _listdir(d):
                try:
                    st = os.stat(os.path.join(d, n))
                except OSError:
                    continue
                if n == RECORD:
                    used = st.st_mtime
                elif n != LOCK:
                    size += st.st_size
            if size:
                out.append((used if used is not None else 0.0, d, size))
    return out


def _listdir(d: str) -> list[str]:
    try:
        return os.listdir(d)
    except OSError:
        return []


def evict(root: str, max_bytes: int, keep: str) -> int:
    """Remove least recently used entries of the cache at ``root`` (never ``keep``'s directory) until it
    holds at most ``max_bytes``, as far as entries not in use allow; the bytes it holds then."""
    entries = _entries(root)
    total = sum(size for _, _, size in entries)
    for _, d, size in sorted(entries):
        if total <= max_bytes:
            break
        if d != keep and _remove(d):
            total -= size
    return total


def _remove(d: str) -> bool:
    """Remove entry ``d``'s copy and record, unless a fetch holds it or a process has its copy open."""
    try:
        lock = os.open(os.path.join(d, LOCK), os.O_RDWR)
    except OSError:
        return False
    held: list[int] = []
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        names = [n for n in _listdir(d) if n not in (LOCK, RECORD)]
        for n in names:
            if ".tmp-" in n:
                continue  # a killed fetch's leftover (the entry lock is ours): removed below
            fd = os.open(os.path.join(d, n), os.O_RDONLY | os.O_NOFOLLOW)
            held.append(fd)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # open or mapped elsewhere: BlockingIOError
        unlink_quietly(os.path.join(d, RECORD))
        for n in names:
            unlink_quietly(os.path.join(d, n))
        return True
    except OSError:
        return False
    finally:
        for fd in held:
            os.close(fd)
        os.close(lock)
