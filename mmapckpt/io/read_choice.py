"""Which way to read a cold file: chosen per device from what reads on that device measured.

Disks differ: one virtual disk here read a cold file with two threads at 0.65 of one stream,
another (the GPU machine's) at 1.16-1.28 with several. So the choice is measured, not assumed.
The first large cold reads on a device (``st_dev``) read a slice of their bytes with each
candidate (:data:`CANDIDATES`) and time it; once every candidate has :data:`TRIALS` samples,
:func:`choose` picks one for that device from the medians. Every :data:`RETRY`-th large cold read
after that tries each candidate once more (the last :data:`KEEP` samples count), so the choice
follows a disk whose load changes (a shared virtual disk). A parallel way is picked
only when its median beats one stream's by :data:`MARGIN`, so a device where parallel reads
lose keeps one stream. Nothing is stored on disk: a decision costs one or two loads' slices.
``MMAPCKPT_COLD_READS`` (``stream``, ``buffered-4``, ``direct-8``, ...) fixes the way instead.
"""

from __future__ import annotations

import os
import statistics
import threading
from collections.abc import Mapping, Sequence
from typing import NamedTuple

__all__ = ["Strategy", "STREAM", "CANDIDATES", "TRIALS", "MARGIN", "TRIAL_BYTES", "RETRY", "KEEP", "choose", "parse",
           "Segment", "segments", "plan", "record", "unsupported", "forget"]


class Strategy(NamedTuple):
    """A way of reading a cold file's regions: ``kind`` ``stream`` (one buffered stream in file order, the
    kernel reading ahead), ``buffered`` or ``direct`` (O_DIRECT into aligned buffers), over ``streams``
    contiguous runs read at once, each through its own descriptor."""

    kind: str
    streams: int = 1

    @property
    def name(self) -> str:
        return "stream" if self.kind == "stream" else f"{self.kind}-{self.streams}"


STREAM = Strategy("stream")
#: What is tried on each device. Four buffered streams and eight O_DIRECT ones were the best of
#: their kinds on the development VM's virtual disk (1, 2, 4 buffered; 1, 2, 4, 8 O_DIRECT).
CANDIDATES = (STREAM, Strategy("buffered", 4), Strategy("direct", 8))
#: Samples of each candidate before a device's choice is made.
TRIALS = 3
#: Once a device's choice is made, every RETRY-th large cold read on it measures every candidate again.
RETRY = 16
#: Samples kept per candidate and device (the latest).
KEEP = 5
#: How much faster (median throughput) a parallel way must be than one stream to be chosen.
MARGIN = 1.1
#: Bytes of a cold read given to each candidate on trial; reads shorter than
#: ``2 * len(CANDIDATES) * TRIAL_BYTES`` are not used for trials.
TRIAL_BYTES = 64 << 20

_ENV = "MMAPCKPT_COLD_READS"


def parse(text: str) -> Strategy:
    """``stream``, ``buffered-N`` or ``direct-N`` as a :class:`Strategy`; ValueError for anything else."""
    if text == "stream":
        return STREAM
    kind, _, n = text.partition("-")
    if kind in ("buffered", "direct") and n.isdigit() and int(n) >= 1:
        return Strategy(kind, int(n))
    raise ValueError(f"{_ENV}={text!r}: expected stream, buffered-N or direct-N")


def choose(samples: Mapping[Strategy, Sequence[float]], *, margin: float = MARGIN) -> Strategy:
    """The way to read, given measured throughputs (any unit, higher is faster) of each way.

    One stream unless a parallel way's median beats one stream's median by ``margin``; without
    samples of one stream, one stream (the way that needs no measurement to be safe).
    """
    base = samples.get(STREAM)
    if not base:
        return STREAM
    best, best_rate = STREAM, statistics.median(base) * margin
    for s, rates in samples.items():
        if s != STREAM and rates and statistics.median(rates) > best_rate:
            best, best_rate = s, statistics.median(rates)
    return best


class Segment(NamedTuple):
    """File offsets ``[lo, hi)`` read by ``strategy``; ``trial``: timed and recorded for the device."""

    strategy: Strategy
    lo: int
    hi: int
    trial: bool


def segments(ranges: Sequence[tuple[int, int]], trials: Sequence[Strategy], rest: Strategy,
             *, trial_bytes: int = TRIAL_BYTES) -> list[Segment]:
    """Split the sorted ``(offset, length)`` ranges of one file: about ``trial_bytes`` of them for each of
    ``trials`` in turn, then the rest for ``rest``. Boundaries fall between ranges, so each lies in one."""
    out: list[Segment] = []
    if not ranges:
        return [Segment(rest, 0, 1 << 63, False)]
    lo, i = 0, 0
    for s in trials:
        got = 0
        start = i
        while i < len(ranges) and got < trial_bytes:
            got += ranges[i][1]
            i += 1
        if i == start:
            break
        hi = ranges[i][0] if i < len(ranges) else 1 << 63
        out.append(Segment(s, lo, hi, True))
        lo = hi
    if i < len(ranges) or not out:
        out.append(Segment(rest, lo, 1 << 63, False))
    return out


_samples: dict[int, dict[Strategy, list[float]]] = {}
_reads: dict[int, int] = {}  # large cold reads since the device's choice was made
_lock = threading.Lock()


def plan(device: int, ranges: Sequence[tuple[int, int]]) -> list[Segment]:
    """How to read a cold file on ``device`` whose regions are the sorted ``ranges``: trial slices for the
    candidates the device still lacks samples of (only if the read is long enough), then its choice."""
    forced = os.environ.get(_ENV)
    if forced:
        return segments(ranges, (), parse(forced))
    large = sum(n for _, n in ranges) >= 2 * len(CANDIDATES) * TRIAL_BYTES
    with _lock:
        have = _samples.get(device, {})
        lacking = [s for s in CANDIDATES if len(have.get(s, ())) < TRIALS]
        rest = choose(have) if not lacking else STREAM
        if not lacking and large:
            _reads[device] = _reads.get(device, 0) + 1
            if _reads[device] % RETRY == 0:
                lacking = [s for s in CANDIDATES if min(have.get(s, [1.0])) > 0]  # not the refused ones
    return segments(ranges, lacking if large else (), rest, trial_bytes=TRIAL_BYTES)


def record(device: int, strategy: Strategy, nbytes: int, seconds: float) -> None:
    """Add a trial's throughput to the device's samples."""
    if seconds <= 0 or nbytes <= 0:
        return
    with _lock:
        kept = _samples.setdefault(device, {}).setdefault(strategy, [])
        kept.append(nbytes / seconds)
        del kept[:-KEEP]


def unsupported(device: int, strategy: Strategy) -> None:
    """The device refused ``strategy`` (O_DIRECT on a tmpfs): never try or choose it there."""
    with _lock:
        _samples.setdefault(device, {})[strategy] = [0.0] * TRIALS


def forget() -> None:
    """Drop every device's samples (the next cold reads measure again)."""
    with _lock:
        _samples.clear()
        _reads.clear()
