"""A small progress bar for long byte-moving commands: bytes done / total and throughput.

It draws on a terminal only: when the stream is not a tty (a pipe, a file, a test)
or the caller asked for quiet, every method is a no-op, so callers never branch.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["Progress", "human_bytes"]

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def human_bytes(n: float) -> str:
    """``1536`` -> ``'1.5 KiB'``; exact below 1 KiB."""
    if n < 1024:
        return f"{int(n)} B"
    i = 0
    while n >= 1024 and i < len(_UNITS) - 1:
        n /= 1024.0
        i += 1
    return f"{n:.1f} {_UNITS[i]}"


class Progress:
    """Progress of a job that moves ``total`` bytes, drawn on one terminal line.

    Args:
        total: bytes the job will move (0 if unknown: the bar then shows bytes and rate only).
        label: a short word shown before the bar.
        enabled: False silences it entirely (``--quiet``).
        stream: where to draw (default ``sys.stderr``); nothing is drawn unless it is a tty.
        min_interval: seconds between redraws, so that many small updates stay cheap.

    Example:
        >>> with Progress(2 << 20, "copy") as bar:
        ...     bar.advance(1 << 20); bar.advance(1 << 20)
    """

    def __init__(self, total: int, label: str, *, enabled: bool = True, stream: TextIO | None = None,
                 min_interval: float = 0.1) -> None:
        self.stream = stream if stream is not None else sys.stderr
        isatty = getattr(self.stream, "isatty", None)
        self.active = bool(enabled and callable(isatty) and isatty())
        self.total = max(0, int(total))
        self.label = label
        self.done = 0
        self.min_interval = min_interval
        self._start = time.monotonic()
        self._last_draw = 0.0
        self._drawn = False
        self._width = 0

    def advance(self, n: int) -> None:
        """Record ``n`` more bytes done and redraw if enough time has passed."""
        self.done += n
        if not self.active:
            return
        now = time.monotonic()
        if now - self._last_draw >= self.min_interval:
            self._draw(now)

    def line(self, now: float | None = None) -> str:
        """The text of the bar as it would be drawn now."""
        now = time.monotonic() if now is None else now
        elapsed = max(now - self._start, 1e-9)
        rate = f"{human_bytes(self.done / elapsed)}/s"
        if self.total:
            frac = min(1.0, self.done / self.total)
            filled = int(frac * 24)
            bar = "#" * filled + "." * (24 - filled)
            return (f"{self.label} [{bar}] {frac * 100:5.1f}% "
                    f"{human_bytes(self.done)} / {human_bytes(self.total)}  {rate}")
        return f"{self.label} {human_bytes(self.done)}  {rate}"

    def _draw(self, now: float) -> None:
        text = self.line(now)
        pad = " " * max(0, self._width - len(text))
        self.stream.write("\r" + text + pad)
        self.stream.flush()
        self._width = len(text)
        self._last_draw = now
        self._drawn = True

    def close(self) -> None:
        """Draw the final state and end the line (only if anything was drawn)."""
        if not self.active:
            return
        if self._drawn or self.done:
            self._draw(time.monotonic())
            self.stream.write("\n")
            self.stream.flush()
        self.active = False

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
