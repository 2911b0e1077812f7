"""The disk's cold read limits: one stream or several, buffered or O_DIRECT, over one file or several.

A load that reads with many concurrent requests can beat one sequential stream on a
device with deep queues, and lose to it on one without (two threads reading one cold
file here ran at 0.65 of one stream). So the benchmark measures the disk both ways and
holds each cold load to the best it measured:

- ``N`` O_DIRECT streams into page-aligned buffers, over disjoint ranges of one file, or
  each over its own share of several files;
- ``N`` buffered streams (through the page cache and its readahead) over disjoint ranges
  of one file;

for ``N`` in :data:`STREAMS`. Every stream owns one buffer, made once and reused by every
later call (a fresh buffer a call costs its page faults inside the timed read: about 60 ms
a GB here). The files are evicted from the page cache before each read.
"""

from __future__ import annotations

import mmap
import os
import threading
import time

from .system import CHUNK, evict

__all__ = ["PARTS", "STREAMS", "SWEEP", "read_streams", "limit_label", "buffers_for"]

#: How many files the several-files limit reads (the state dict's size in all).
PARTS = 16
#: The stream counts of the sweep.
STREAMS = (1, 2, 4, 8, 16)
#: (limit name, streams, O_DIRECT, several files) of every parallel limit the benchmark measures.
SWEEP: tuple[tuple[str, int, bool, bool], ...] = tuple(
    [(f"read_direct_x{n}", n, True, False) for n in STREAMS]
    + [(f"read_buffered_x{n}", n, False, False) for n in STREAMS if n > 1]
    + [(f"read_direct_files_x{n}", n, True, True) for n in STREAMS if n > 1])
_ALIGN = 1 << 20  # range boundaries: a multiple of any device's O_DIRECT block
_BLOCK = 4096
_REGION: list[mmap.mmap] = []
_BUFFERS: dict[int, list[memoryview]] = {}


def chunk_for(streams: int) -> int:
    """Each stream's I/O size: 64 MiB in all, at least 4 MiB a stream."""
    return max(4 << 20, CHUNK // streams)


def buffers_for(streams: int) -> list[memoryview]:
    """The streams' buffers: page-aligned slices of one anonymous map, faulted in once, kept for later calls."""
    if streams not in _BUFFERS:
        size = chunk_for(streams) * streams
        if not _REGION or len(_REGION[0]) < size:
            region = mmap.mmap(-1, size)
            region.write(b"\1" * size)  # fault every page in now, not inside a timed read
            _REGION[:] = [region]
            _BUFFERS.clear()
        whole = memoryview(_REGION[0])
        _BUFFERS[streams] = [whole[i * chunk_for(streams):(i + 1) * chunk_for(streams)] for i in range(streams)]
    return _BUFFERS[streams]


def limit_label(name: str) -> str:
    """'read_direct_files_x4' -> '4 O_DIRECT streams, 16 files'."""
    kind, _, n = name.removeprefix("read_").rpartition("_x")
    streams = f"{n} {'O_DIRECT' if kind.startswith('direct') else 'buffered'} stream{'s' if n != '1' else ''}"
    return streams + (f", {PARTS} files" if kind.endswith("files") else "")


def _ranges(paths: list[str], streams: int) -> list[list[tuple[str, int, int]]]:
    """Each stream's (path, start, end) pieces: disjoint ranges of one file, or whole files dealt round."""
    if len(paths) > 1:
        return [[(p, 0, os.path.getsize(p)) for p in paths[i::streams]] for i in range(streams)]
    size = os.path.getsize(paths[0])
    step = -(-size // streams // _ALIGN) * _ALIGN or _ALIGN
    return [[(paths[0], min(i * step, size), min((i + 1) * step, size))] for i in range(streams)]


def _read_range(path: str, start: int, end: int, view: memoryview, direct: bool) -> int:
    flags = os.O_RDONLY | (getattr(os, "O_DIRECT", 0) if direct else 0)
    fd = os.open(path, flags)
    done = 0
    try:
        off = start
        while off < end:
            n = min(len(view), end - off)
            if direct:
                n = -(-n // _BLOCK) * _BLOCK  # O_DIRECT lengths are whole blocks; the read stops at EOF
            got = os.preadv(fd, [view[:n]], off)
            if got <= 0:
                break
            got = min(got, end - off)
            off += got
            done += got
    finally:
        os.close(fd)
    return done


def read_streams(paths: list[str], streams: int, *, direct: bool) -> float | None:
    """Seconds to read every byte of ``paths`` from a cold page cache with ``streams`` threads.

    One path: the streams read disjoint ranges of it. Several: each stream reads its share
    of the files (file ``i`` goes to stream ``i % streams``). Returns None where a file refuses
    O_DIRECT. Raises OSError if fewer bytes came back than the files hold.
    """
    evict(paths)
    bufs = buffers_for(streams)
    plan = _ranges(paths, streams)
    if direct:
        try:
            os.close(os.open(paths[0], os.O_RDONLY | getattr(os, "O_DIRECT", 0)))
        except OSError:
            return None
    done = [0] * streams
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            for path, start, end in plan[i]:
                done[i] += _read_range(path, start, end, bufs[i], direct)
        except BaseException as e:  # noqa: BLE001 - raised again in the caller's thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(streams)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    if errors:
        raise errors[0]
    total = sum(os.path.getsize(p) for p in paths)
    if sum(done) != total:
        raise OSError(f"read {sum(done)} bytes of {total} from {paths[0]}{' and others' if len(paths) > 1 else ''}")
    return elapsed
