"""Read-once from a medium without mappings (an object store): the reader rank fetches its records in windows.

A mapped record is sent as a view of its pages. An unmapped one (:class:`RemoteRecord`) is
read when its pieces are sent, never held whole: :class:`RecordFetcher` reads the records
this rank sends, in the order they are sent, a window of up to ``window`` bytes at a time
(consecutive records of one file in one ``StoredFile.read_batch``: on an object store,
neighbouring records join into one ranged GET), so a rank that sends many small records
makes few requests, and memory stays one window. A record longer than the window is read
piece by piece, each piece straight into the buffer it is sent from.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from ..storage.base import StoredFile

__all__ = ["RemoteRecord", "RecordFetcher"]

_ALIGN = 64


class RemoteRecord(NamedTuple):
    """A stored record of an unmapped file: its bytes are at ``offset``, ``length`` long."""

    stored: StoredFile
    offset: int
    length: int
    label: str


class RecordFetcher:
    """The bytes of this rank's remote records, fetched in windows (see the module docstring).

    Args:
        order: the records this rank sends, in the order it sends them.
        window: the most bytes fetched (and held) at once.
    """

    def __init__(self, order: list[tuple[Any, RemoteRecord]], window: int) -> None:
        self.order = order
        self.at = {idx: i for i, (idx, _) in enumerate(order)}
        self.window = max(1, window)
        self.held: dict[Any, torch.Tensor] = {}

    def piece(self, idx: Any, off: int, n: int, into: torch.Tensor | None = None) -> torch.Tensor:
        """Bytes ``[off, off + n)`` of record ``idx`` as a CPU uint8 tensor (read into ``into`` where the
        record is read piece by piece and ``into`` is given)."""
        if idx not in self.held:
            rec = self.order[self.at[idx]][1]
            if rec.length > self.window:
                out = into[:n] if into is not None else torch.empty(n, dtype=torch.uint8)
                rec.stored.read_into(rec.offset + off, out.numpy(), entry=rec.label)
                return out
            self._fetch_from(self.at[idx])
        return self.held[idx][off:off + n]

    def _fetch_from(self, i: int) -> None:
        """Fetch record ``i`` and the records after it in the same file, up to the window."""
        first = self.order[i][1]
        take, total = [], 0
        for idx, rec in self.order[i:]:
            if rec.stored is not first.stored or (take and total + rec.length > self.window):
                break
            take.append((idx, rec, total))
            total += -(-rec.length // _ALIGN) * _ALIGN  # each record aligned, to be viewed as its dtype
        buf = torch.empty(total, dtype=torch.uint8)
        self.held = {idx: buf[a:a + rec.length] for idx, rec, a in take}
        first.stored.read_batch([(rec.offset, self.held[idx].numpy()) for idx, rec, _ in take if rec.length],
                                entry=first.label if len(take) == 1 else None)
