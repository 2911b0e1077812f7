"""Progress of long byte-moving jobs (convert, verify): phases, bytes done / total, elapsed time and ETA.

Shown on a terminal only: when the stream is not a tty (a pipe, a file, a test) or the caller
asked for quiet, nothing is drawn, so callers never branch. The bar is tqdm's where tqdm is
installed (the ``progress`` extra), else a plain one-line bar with the same facts. A callback
(``convert(progress=callable)``) gets every step, terminal or not.

A job is a sequence of phases (``phase(name, nbytes)``); ``done`` and ``total`` count the bytes of
all of them, so the bar reaches 100% only when the last phase ends.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

__all__ = ["Progress", "ProgressCallback", "MIN_INTERVAL", "human_bytes", "format_duration"]

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")

#: Seconds between redraws and callback calls, unless a Progress is given its own.
MIN_INTERVAL = 0.1

#: ``callback(phase, done, total)``: the phase's name and the bytes done and in all, counted over every phase.
ProgressCallback = Callable[[str, int, int], Any]


def human_bytes(n: float) -> str:
    """``1536`` -> ``'1.5 KiB'``; exact below 1 KiB."""
    if n < 1024:
        return f"{int(n)} B"
    i = 0
    while n >= 1024 and i < len(_UNITS) - 1:
        n /= 1024.0
        i += 1
    return f"{n:.1f} {_UNITS[i]}"


def format_duration(seconds: float) -> str:
    """``75.2`` -> ``'01:15'``, ``3725`` -> ``'1:02:05'`` (as tqdm writes them)."""
    s = max(0, int(seconds + 0.5))
    h, rem = divmod(s, 3600)
    return f"{h}:{rem // 60:02d}:{rem % 60:02d}" if h else f"{rem // 60:02d}:{rem % 60:02d}"


def _tqdm() -> Any:
    try:
        from tqdm import tqdm
    except ImportError:  # the progress extra is optional: the plain bar says the same
        return None
    return tqdm


class Progress:
    """Progress of a job that moves ``total`` bytes, in phases, drawn on one terminal line.

    Args:
        total: bytes the job will move over all its phases (0 if unknown: bytes and rate only).
        label: a short text shown before the bar (``"mmapckpt -> torch"``).
        enabled: False draws nothing (``--quiet``); a callback is still called.
        stream: where to draw (default ``sys.stderr``); nothing is drawn unless it is a tty.
        min_interval: seconds between redraws (and callback calls), so many small updates stay cheap
            (default :data:`MIN_INTERVAL`).
        callback: ``callback(phase, done, total)`` after each phase starts, at most every ``min_interval``
            seconds while bytes move, and once when the job ends (``done == total``).

    Example:
        >>> with Progress(2 << 20, "copy") as bar:
        ...     bar.advance(1 << 20); bar.advance(1 << 20)
    """

    def __init__(self, total: int, label: str, *, enabled: bool = True, stream: TextIO | None = None,
                 min_interval: float | None = None, callback: ProgressCallback | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        isatty = getattr(self.stream, "isatty", None)
        self.active = bool(enabled and callable(isatty) and isatty())
        self.total = max(0, int(total))
        self.label = label
        self.done = 0
        self.phase_name = ""
        self.min_interval = MIN_INTERVAL if min_interval is None else min_interval
        self.callback = callback
        self._phase_end: int | None = None
        self._reported: tuple[str, int, int] | None = None
        self._start = time.monotonic()
        self._last = 0.0
        self._drawn = False
        self._width = 0
        tqdm = _tqdm() if self.active else None
        self._tqdm = None if tqdm is None else tqdm(
            total=self.total or None, desc=label, unit="B", unit_scale=True, unit_divisor=1024, file=self.stream,
            mininterval=self.min_interval, dynamic_ncols=True, leave=True)

    def phase(self, name: str, nbytes: int = 0) -> None:
        """Start phase ``name``, which will move ``nbytes`` of the total (0: one that only waits, e.g. a sync).

        The bytes of an earlier phase that were not all advanced are counted as done now.
        """
        self._finish_phase()
        self.phase_name = name
        self._phase_end = self.done + max(0, int(nbytes))
        if self._tqdm is not None:
            self._tqdm.set_description(f"{self.label}: {name}", refresh=False)
        self._update(force=True)

    def _finish_phase(self) -> None:
        if self._phase_end is not None and self.done < self._phase_end:
            self._add(self._phase_end - self.done)

    def _add(self, n: int) -> None:
        self.done += n
        if self._tqdm is not None:
            self._tqdm.update(n)

    def advance(self, n: int) -> None:
        """Record ``n`` more bytes done (within the current phase's bytes, where one was started)."""
        if self._phase_end is not None:
            n = min(n, self._phase_end - self.done)
        if n > 0:
            self._add(n)
        self._update()

    def _update(self, force: bool = False) -> None:
        if not (self.active or self.callback):
            return
        now = time.monotonic()
        if not force and now - self._last < self.min_interval:
            return
        self._last = now
        self._call(self.phase_name, self.done, self.total)
        if self.active and self._tqdm is None:
            self._draw(now)

    def _call(self, phase: str, done: int, total: int) -> None:
        if self.callback is not None and (phase, done, total) != self._reported:  # no call repeats the last
            self._reported = (phase, done, total)
            self.callback(phase, done, total)

    def line(self, now: float | None = None) -> str:
        """The text of the plain bar as it would be drawn now: phase, bar, bytes, rate, elapsed and ETA."""
        now = time.monotonic() if now is None else now
        elapsed = max(now - self._start, 1e-9)
        speed = self.done / elapsed
        rate = f"{human_bytes(speed)}/s"
        name = f"{self.label}: {self.phase_name}" if self.phase_name else self.label
        if self.total:
            frac = min(1.0, self.done / self.total)
            filled = int(frac * 24)
            bar = "#" * filled + "." * (24 - filled)
            eta = format_duration((self.total - self.done) / speed) if self.done else "?"
            return (f"{name} [{bar}] {frac * 100:5.1f}% {human_bytes(self.done)} / {human_bytes(self.total)}  "
                    f"{rate}  {format_duration(elapsed)} elapsed, ETA {eta}")
        return f"{name} {human_bytes(self.done)}  {rate}  {format_duration(elapsed)} elapsed"

    def _draw(self, now: float) -> None:
        text = self.line(now)
        pad = " " * max(0, self._width - len(text))
        self.stream.write("\r" + text + pad)
        self.stream.flush()
        self._width = len(text)
        self._drawn = True

    def close(self) -> None:
        """End the job: the last phase's bytes count as done, the callback hears ``done == total`` and the
        bar is drawn in its final state (only if anything was drawn)."""
        if self._phase_end is None and self.callback is None and not self.active:
            return
        self._finish_phase()
        self._phase_end = None
        self._call(self.phase_name or "done", self.done, max(self.total, self.done))
        self.callback = None
        if self._tqdm is not None:
            self._tqdm.close()
            self._tqdm = None
        elif self.active and (self._drawn or self.done):
            self._draw(time.monotonic())
            self.stream.write("\n")
            self.stream.flush()
        self.active = False

    def abandon(self) -> None:
        """End the line without counting anything more done (the job failed or was interrupted)."""
        self._phase_end = None
        self.callback = None
        if self._tqdm is not None:
            self._tqdm.close()
            self._tqdm = None
        elif self.active and self._drawn:
            self.stream.write("\n")
            self.stream.flush()
        self.active = False

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, kind: object, exc: object, tb: object) -> None:
        if exc is None:
            self.close()
        else:
            self.abandon()
