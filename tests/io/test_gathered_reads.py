"""Reads of many pieces on one thread (io/reads.py ``pread_all``): neighbouring pieces gathered into one ``preadv``.

Every piece must hold the file's bytes at its offset, whatever the layout (gaps up to and beyond the gathered gap,
overlaps, long runs past the buffer limit); a file that ends early must raise TruncatedFileError naming the piece it
ends in; and neighbours must be read by one call each run (counted at ``os.preadv``, the real call). Also
``run_tasks``, which runs the last of a load's parallel runs on the calling thread.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mmapckpt.errors import TruncatedFileError
from mmapckpt.io import reads
from mmapckpt.io.reads import GATHER_GAP, ReadJob, pread_all


def _file(tmp_path, size: int, seed: int = 0) -> tuple[str, bytes]:
    data = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()
    path = str(tmp_path / "data.bin")
    with open(path, "wb") as f:
        f.write(data)
    return path, data


def _read(path: str, layout: list[tuple[int, int]]) -> list[np.ndarray]:
    bufs = [np.full(n, 0xA5, dtype=np.uint8) for _, n in layout]
    fd = os.open(path, os.O_RDONLY)
    try:
        pread_all(fd, [ReadJob(b, off, f"e{k}") for k, (b, (off, _)) in enumerate(zip(bufs, layout))], path)
    finally:
        os.close(fd)
    return bufs


@st.composite
def _layouts(draw):
    """Pieces in file order: each after the last, or overlapping it, with gaps below, at and above GATHER_GAP."""
    out, pos = [], 0
    for _ in range(draw(st.integers(1, 40))):
        gap = draw(st.sampled_from([0, 1, 63, 4096, GATHER_GAP, GATHER_GAP + 1, -100]))
        start = max(0, pos + gap)
        n = draw(st.integers(1, 20_000))
        out.append((start, n))
        pos = start + n
    return out


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(layout=_layouts())
def test_every_piece_holds_the_files_bytes(tmp_path, layout):
    size = max(o + n for o, n in layout)
    path, data = _file(tmp_path, size)
    for (off, n), buf in zip(layout, _read(path, layout)):
        assert buf.tobytes() == data[off:off + n]


def test_neighbours_are_read_by_one_call_a_run(tmp_path, monkeypatch):
    # two runs, apart by more than GATHER_GAP: 300 pieces with 96-byte gaps (599 buffers, gaps included: calls of
    # 511 and 87 at the 512-buffer limit), then 600 pieces with 28-byte gaps (1199 buffers: 511, 511 and 175)
    layout = [(k * 4096, 4000) for k in range(300)]
    far = layout[-1][0] + 4096 + GATHER_GAP + 1
    layout += [(far + k * 128, 100) for k in range(600)]
    path, data = _file(tmp_path, max(o + n for o, n in layout))
    calls = []
    real = os.preadv

    def counted(fd, bufs, offset, *a):
        calls.append(len(bufs))
        return real(fd, bufs, offset, *a)

    monkeypatch.setattr(reads.os, "preadv", counted)
    for (off, n), buf in zip(layout, _read(path, layout)):
        assert buf.tobytes() == data[off:off + n]
    assert calls == [511, 87, 511, 511, 175], calls


def test_a_file_ending_inside_a_run_names_the_piece(tmp_path):
    layout = [(k * 1024, 1000) for k in range(10)]
    path, _ = _file(tmp_path, 5 * 1024 + 500)  # ends inside piece 5
    with pytest.raises(TruncatedFileError) as info:
        _read(path, layout)
    assert info.value.entry == "e5"
    assert path in str(info.value)



def test_the_last_task_runs_here_and_an_error_waits_for_the_others():
    """``run_tasks``: the calling thread runs the last task (only that one); where it raises, the tasks on the reader
    threads have finished before the error leaves (the caller then closes the descriptors they read from)."""
    import threading
    import time

    from mmapckpt.io.reads import run_tasks

    here = threading.get_ident()
    where, finished = [], []

    def note():
        where.append(threading.get_ident())

    run_tasks([note, note, note], threads=3)
    assert len(where) == 3 and where.count(here) == 1

    def slow():
        time.sleep(0.2)
        finished.append(threading.get_ident())

    def fails():
        raise TruncatedFileError("ends early", path="p", entry="e")

    with pytest.raises(TruncatedFileError):
        run_tasks([slow, slow, fails], threads=3)
    assert len(finished) == 2 and here not in finished
