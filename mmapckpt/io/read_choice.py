"""Which way to read a cold file: chosen per device from what reads on that device measured.

Disks differ: one virtual disk here read a cold file with two threads at 0.65 of one stream,
another (the GPU machine's) at 1.16-1.28 with several. So the choice is measured, not assumed.
The first large cold reads on a device (``st_dev``) read a slice of their bytes with each
candidate (:func:`candidates`) and time it; once every candidate has :data:`TRIALS` samples,
:func:`choose` picks one for that device from the medians. Every :data:`RETRY`-th large cold read
after that tries each candidate once more (the last :data:`KEEP` samples count), so the choice
follows a disk whose load changes (a shared virtual disk). A parallel way is picked
only when its median beats one stream's by :data:`MARGIN`, so a device where parallel reads
lose keeps one stream. ``MMAPCKPT_COLD_READS`` (``stream``, ``buffered-4``, ``direct-8``, ...)
fixes the way instead.

Two rules keep the choice from costing what it should save:

- **Measured once per device and boot, not per process.** The samples are kept in a small JSON
  file (:func:`state_path`: ``$MMAPCKPT_READ_CHOICE``, else ``$XDG_CACHE_HOME/mmapckpt/read-choice.json``
  or ``~/.cache/mmapckpt/read-choice.json``; ``MMAPCKPT_READ_CHOICE=off`` keeps them in memory only),
  keyed by the kernel's boot id and the device number (``st_dev`` numbers are only stable within
  a boot), so a new process (a server starting, a job resuming) reads cold with what earlier
  processes measured instead of running the trials again. The file is a cache: it is replaced
  atomically, and one that cannot be read or written is ignored.
- **A load never leaves a file less cached than a buffered read would.** O_DIRECT reads bypass
  the page cache, so the next load of what they read is cold again (issue 44 measured 34-42 MB of
  0.5 GB left uncached by the trials, and the next "warm" loads at half speed). O_DIRECT ways are
  candidates only for a read larger than the memory the page cache could give it
  (``MemAvailable``, :func:`cache_room`), where a buffered read would not keep it cached either.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
from collections.abc import Mapping, Sequence

from ..records import Record
from .files import available_memory

__all__ = ["Strategy", "STREAM", "CANDIDATES", "TRIALS", "MARGIN", "TRIAL_BYTES", "PARALLEL_BYTES", "RETRY", "KEEP",
           "choose", "parse", "Segment", "segments", "plan", "fitted", "record", "unsupported", "forget", "candidates",
           "cache_room", "state_path"]


class Strategy(Record):
    """A way of reading a cold file's regions: ``kind`` ``stream`` (one buffered stream in file order, the
    kernel reading ahead), ``buffered`` or ``direct`` (O_DIRECT into aligned buffers), over ``streams``
    contiguous runs read at once, each through its own descriptor."""

    __slots__ = ()

    kind: str
    streams: int

    def __new__(cls, kind: str, streams: int = 1) -> Strategy:
        return tuple.__new__(cls, (kind, streams))

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
#: Cold reads shorter than this are read by one stream, whatever was chosen (:func:`fitted`); a longer one is
#: read by at most one stream of a parallel way per :data:`TRIAL_BYTES`. Each stream of a parallel way ramps up
#: its own readahead (and a new process starts its threads). Fresh processes, cold ``load_into`` of 323 tensors
#: on the development VM, the ways alternately (medians of 6-8 pairs, load average 1.1-1.5): 256 MB, one stream
#: 110-118 ms against ``buffered-2`` 206 and ``buffered-4`` 160 (one stream faster in 7 and 8 of 8 pairs);
#: 512 MB, 328-413 ms against 254 and 256; 1 GB, 514 against ``buffered-4`` 429 (parallel faster in 5 of 6).
PARALLEL_BYTES = 512 << 20

_ENV = "MMAPCKPT_COLD_READS"


def parse(text: str) -> Strategy:
    """``stream``, ``buffered-N`` or ``direct-N`` as a :class:`Strategy`; ValueError for anything else."""
    if text == "stream":
        return STREAM
    kind, _, n = text.partition("-")
    if kind in ("buffered", "direct") and n.isdigit() and int(n) >= 1:
        return Strategy(kind, int(n))
    raise ValueError(f"{_ENV}={text!r}: expected stream, buffered-N or direct-N")


def _median(xs: Sequence[float]) -> float:
    """``statistics.median``, without importing it (with ``fractions`` and ``decimal``) into every load."""
    s = sorted(xs)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2


def choose(samples: Mapping[Strategy, Sequence[float]], *, margin: float = MARGIN) -> Strategy:
    """The way to read, given measured throughputs (any unit, higher is faster) of each way.

    One stream unless a parallel way's median beats one stream's median by ``margin``; without
    samples of one stream, one stream (the way that needs no measurement to be safe).
    """
    base = samples.get(STREAM)
    if not base:
        return STREAM
    best, best_rate = STREAM, _median(base) * margin
    for s, rates in samples.items():
        if s != STREAM and rates and _median(rates) > best_rate:
            best, best_rate = s, _median(rates)
    return best


class Segment(Record):
    """File offsets ``[lo, hi)`` read by ``strategy``; ``trial``: timed and recorded for the device."""

    __slots__ = ()

    strategy: Strategy
    lo: int
    hi: int
    trial: bool

    def __new__(cls, strategy: Strategy, lo: int, hi: int, trial: bool) -> Segment:
        return tuple.__new__(cls, (strategy, lo, hi, trial))


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
_loaded: set[int] = set()  # devices whose kept samples were read from the state file
_reads: dict[int, int] = {}  # large cold reads since the device's choice was made
_lock = threading.Lock()
_STATE_ENV = "MMAPCKPT_READ_CHOICE"


def cache_room() -> int | None:
    """Bytes the page cache could hold now without evicting what a process uses (``MemAvailable``), or None
    where the kernel does not say (io/files.py ``available_memory``; a name of its own here, which the tests
    set)."""
    return available_memory()


def candidates(nbytes: int) -> tuple[Strategy, ...]:
    """The ways tried for a cold read of ``nbytes``: O_DIRECT ones only where the read is larger than the
    page cache's room (:func:`cache_room`), so that what fits stays cached for the next load."""
    room = cache_room()
    direct = room is not None and nbytes > room
    return tuple(s for s in CANDIDATES if s.kind != "direct" or direct)


def state_path() -> str | None:
    """The file the samples are kept in across processes (see the module), or None when it is turned off."""
    given = os.environ.get(_STATE_ENV)
    if given is not None:
        return None if given.strip().lower() in ("", "off", "0", "none") else given
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "mmapckpt", "read-choice.json")


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return "unknown-boot"


def _key(device: int) -> str:
    return f"{_boot_id()}/{os.major(device)}:{os.minor(device)}"


def _read_state(path: str) -> dict[str, dict[str, list[float]]]:
    try:
        with open(path, "rb") as f:
            doc = json.loads(f.read(1 << 20))
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def _load(device: int) -> None:
    """Merge the device's kept samples into memory, once per process (under ``_lock``)."""
    if device in _loaded:
        return
    _loaded.add(device)
    path = state_path()
    kept = _read_state(path).get(_key(device)) if path else None
    if not isinstance(kept, dict):
        return
    names = {s.name: s for s in CANDIDATES}
    have = _samples.setdefault(device, {})
    for name, rates in kept.items():
        s = names.get(name) if isinstance(name, str) else None
        if s is None or not isinstance(rates, list) or s in have:
            continue
        good = [float(r) for r in rates if isinstance(r, (int, float)) and r == r and r >= 0]
        if good:
            have[s] = good[-KEEP:]


def _store(device: int) -> None:
    """Write the device's samples into the state file (under ``_lock``); failures are ignored (a cache)."""
    path = state_path()
    if not path:
        return
    doc = _read_state(path)
    doc[_key(device)] = {s.name: rates for s, rates in _samples.get(device, {}).items()}
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".read-choice.", dir=os.path.dirname(path) or ".")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(doc, f)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError:
        pass


def plan(device: int, ranges: Sequence[tuple[int, int]]) -> list[Segment]:
    """How to read a cold file on ``device`` whose regions are the sorted ``ranges``: trial slices for the
    candidates the device still lacks samples of (only if the read is long enough), then its choice."""
    forced = os.environ.get(_ENV)
    if forced:
        return segments(ranges, (), parse(forced))
    total = sum(n for _, n in ranges)
    # shorter than a read with trials of the fewest candidates (two) and than a parallel read: the samples unread
    if total < min(PARALLEL_BYTES, 2 * 2 * TRIAL_BYTES):
        return segments(ranges, (), STREAM)
    ways = candidates(total)
    large = total >= 2 * len(ways) * TRIAL_BYTES
    with _lock:
        _load(device)
        have = {s: r for s, r in _samples.get(device, {}).items() if s in ways}
        lacking = [s for s in ways if len(have.get(s, ())) < TRIALS]
        rest = choose(have) if not lacking else STREAM
        if not lacking and large:
            _reads[device] = _reads.get(device, 0) + 1
            if _reads[device] % RETRY == 0:
                lacking = [s for s in ways if min(have.get(s, [1.0])) > 0]  # not the refused ones
    return segments(ranges, lacking if large else (), fitted(rest, total), trial_bytes=TRIAL_BYTES)


def fitted(way: Strategy, nbytes: int) -> Strategy:
    """``way`` for a read of ``nbytes``: one stream below :data:`PARALLEL_BYTES`, else its streams cut to those that
    get :data:`TRIAL_BYTES` each."""
    if way.kind == "stream" or nbytes < PARALLEL_BYTES:
        return STREAM
    n = min(way.streams, nbytes // TRIAL_BYTES)
    return STREAM if n <= 1 else Strategy(way.kind, n)


def record(device: int, strategy: Strategy, nbytes: int, seconds: float) -> None:
    """Add a trial's throughput to the device's samples."""
    if seconds <= 0 or nbytes <= 0:
        return
    with _lock:
        _load(device)
        kept = _samples.setdefault(device, {}).setdefault(strategy, [])
        kept.append(nbytes / seconds)
        del kept[:-KEEP]
        _store(device)


def unsupported(device: int, strategy: Strategy) -> None:
    """The device refused ``strategy`` (O_DIRECT on a tmpfs): never try or choose it there."""
    with _lock:
        _load(device)
        _samples.setdefault(device, {})[strategy] = [0.0] * TRIALS
        _store(device)


def forget() -> None:
    """Drop every device's samples held in this process (the next cold read reads the state file again)."""
    with _lock:
        _samples.clear()
        _loaded.clear()
        _reads.clear()
