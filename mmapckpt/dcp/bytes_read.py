"""How many bytes of checkpoint files one load took, each stored byte counted once.

The read paths report every stored record (file, offset, length) they take bytes
from: all of it (a checksum pass, a stock item read whole, a region sent to other
ranks) or a part (a hypercube narrowed out of a mapped chunk). A record counts its
full length if any pass took all of it, else the sum of its parts, at most its length:
reading a chunk for its CRC and then copying it out of the (now cached) mapping is one
read of those bytes, not two.
"""

from __future__ import annotations

import threading

__all__ = ["BytesRead"]


class BytesRead:
    """Bytes taken from checkpoint files during one load (thread-safe: files are read in parallel)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: (path, offset) -> [record length, taken whole, sum of the parts taken]
        self._records: dict[tuple[str, int], list[int]] = {}

    def take(self, path: str, offset: int, length: int, part: int | None = None) -> None:
        """Note bytes taken from the record at ``offset`` (``length`` bytes long) of ``path``: all of
        it (``part`` None) or ``part`` bytes of it."""
        self.take_all(path, [(offset, length, part)])

    def take_all(self, path: str, taken: list[tuple[int, int, int | None]]) -> None:
        """:meth:`take` for each (offset, length, part) of ``taken``, under one lock."""
        with self._lock:
            records = self._records
            for offset, length, part in taken:
                rec = records.get((path, offset))
                if rec is None:
                    rec = records[(path, offset)] = [length, 0, 0]
                if part is None:
                    rec[1] = 1
                else:
                    rec[2] += part

    @property
    def total(self) -> int:
        with self._lock:
            return sum(n if whole else min(n, parts) for n, whole, parts in self._records.values())

    def clear(self) -> None:
        with self._lock:
            self._records.clear()
