"""The cold-read choice across processes and the page cache (io/read_choice.py).

A new process reads cold with what earlier processes measured on the same device and boot (no
trials again), and a load of a file the page cache can hold never reads it with O_DIRECT, so the
next load is warm. Figures are given, never timed.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import mmapckpt
from mmapckpt.bench.system import evict
from mmapckpt.io import read_choice
from mmapckpt.io.read_choice import STREAM, Strategy

from helpers import assert_bitwise_equal

B4, D8 = Strategy("buffered", 4), Strategy("direct", 8)
PAGE = os.sysconf("SC_PAGE_SIZE")


@pytest.fixture(autouse=True)
def _state_file(tmp_path, monkeypatch):
    path = tmp_path / "state" / "read-choice.json"
    monkeypatch.setenv("MMAPCKPT_READ_CHOICE", str(path))
    monkeypatch.delenv("MMAPCKPT_COLD_READS", raising=False)
    read_choice.forget()
    yield path
    read_choice.forget()


def _big() -> list[tuple[int, int]]:
    n = 64
    # long enough for trials and for a parallel way
    size = max(2 * len(read_choice.CANDIDATES) * read_choice.TRIAL_BYTES, read_choice.PARALLEL_BYTES) // n + 1
    return [(i * size, size) for i in range(n)]


def _plan_in_new_process(device: int) -> list[list]:
    code = textwrap.dedent(f"""
        import json
        from mmapckpt.io import read_choice
        read_choice.cache_room = lambda: 0  # a read larger than memory: every candidate counts
        ranges = {_big()!r}
        print(json.dumps([[s.strategy.name, s.trial] for s in read_choice.plan({device}, ranges)]))
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=dict(os.environ))
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def _measure(device: int, rates: dict[Strategy, float]) -> None:
    for _ in range(read_choice.TRIALS):
        for s, r in rates.items():
            read_choice.record(device, s, int(r * 1e9), 1.0)


def test_a_new_process_uses_what_an_earlier_one_measured(monkeypatch, _state_file):
    monkeypatch.setattr(read_choice, "cache_room", lambda: 0)
    dev = os.makedev(259, 3)
    assert all(trial for _, trial in _plan_in_new_process(dev)[:-1])  # nothing measured yet: trials
    _measure(dev, {STREAM: 1.0, B4: 1.5, D8: 1.2})
    plan = _plan_in_new_process(dev)
    assert plan == [["buffered-4", False]]  # no trial, the earlier choice
    assert _plan_in_new_process(os.makedev(259, 4))[0][1]  # another device measures for itself


def test_samples_of_another_boot_are_not_used(monkeypatch, _state_file):
    monkeypatch.setattr(read_choice, "cache_room", lambda: 0)
    dev = os.makedev(8, 1)
    _measure(dev, {STREAM: 1.0, B4: 1.5, D8: 1.2})
    doc = json.loads(_state_file.read_text())
    (key, kept), = doc.items()
    assert key.endswith("/8:1") and set(kept) == {"stream", "buffered-4", "direct-8"}
    _state_file.write_text(json.dumps({"another-boot/8:1": kept}))  # st_dev numbers mean nothing after a reboot
    assert _plan_in_new_process(dev)[0][1]


@pytest.mark.parametrize("content", [b"\x00garbage", b"[1, 2]", b'{"x": 3}', json.dumps(
    {"B/0:1": {"stream": ["a", None, -1, float("nan")], "direct-8": "many", "nonsense-3": [1.0]}}).encode()])
def test_a_damaged_state_file_is_ignored_and_replaced(monkeypatch, _state_file, content):
    monkeypatch.setattr(read_choice, "cache_room", lambda: 0)
    monkeypatch.setattr(read_choice, "_boot_id", lambda: "B")
    _state_file.parent.mkdir()
    _state_file.write_bytes(content)
    dev = os.makedev(0, 1)
    assert [s.strategy for s in read_choice.plan(dev, _big()) if s.trial] == list(read_choice.CANDIDATES)
    _measure(dev, {STREAM: 2.0, B4: 1.0, D8: 1.0})
    assert json.loads(_state_file.read_text())["B/0:1"]["stream"] == [2e9] * read_choice.TRIALS


def test_off_keeps_the_samples_in_memory(monkeypatch, tmp_path):
    monkeypatch.setenv("MMAPCKPT_READ_CHOICE", "off")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert read_choice.state_path() is None
    _measure(7, {STREAM: 1.0})
    assert not (tmp_path / "xdg").exists() and not (tmp_path / "home").exists()
    monkeypatch.delenv("MMAPCKPT_READ_CHOICE")
    assert read_choice.state_path() == str(tmp_path / "xdg" / "mmapckpt" / "read-choice.json")


def test_o_direct_is_a_candidate_only_for_reads_larger_than_the_page_cache(monkeypatch):
    monkeypatch.setattr(read_choice, "cache_room", lambda: 10 << 30)
    assert read_choice.candidates(1 << 30) == (STREAM, B4)
    assert read_choice.candidates(11 << 30) == read_choice.CANDIDATES
    monkeypatch.setattr(read_choice, "cache_room", lambda: None)  # the kernel does not say: stay buffered
    assert read_choice.candidates(1 << 40) == (STREAM, B4)
    dev = 99
    _measure(dev, {STREAM: 1.0, B4: 1.05, D8: 3.0})  # measured on a read larger than memory, earlier
    monkeypatch.setattr(read_choice, "cache_room", lambda: 10 << 30)
    assert read_choice.plan(dev, _big())[-1].strategy == STREAM  # D8 is not taken for what fits


def _evict(directory: str) -> list[str]:
    files = [os.path.join(directory, n) for n in sorted(os.listdir(directory))]
    evict(files)
    return files


def _uncached_pages(path: str) -> int:
    """Pages of ``path`` not in the page cache, by mincore(2) over a mapping that touches none of them (a
    RWF_NOWAIT probe of each page would start the kernel's readahead and warm the file)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        with mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as m:
            vec = ctypes.create_string_buffer((size + PAGE - 1) // PAGE)
            holder = ctypes.c_char.from_buffer(m)
            try:
                assert libc.mincore(ctypes.addressof(holder), size, vec) == 0, ctypes.get_errno()
            finally:
                del holder
            return sum(not (b & 1) for b in vec.raw)


def test_a_cold_load_with_trials_leaves_the_checkpoint_cached(tmp_path, monkeypatch):
    """Trial slices for every candidate on a small file; what fits in the page cache is read buffered, so after
    the load every page of the shards is cached (an O_DIRECT trial slice would not be)."""
    g = torch.Generator().manual_seed(0)
    sd = {f"w{i}": torch.randn(256, 1024, generator=g) for i in range(24)}  # 24 MiB
    ck = str(tmp_path / "ck")
    mmapckpt.save(sd, ck)
    monkeypatch.setattr(read_choice, "TRIAL_BYTES", 4 << 20)
    # O_DIRECT's trial slice first: behind a buffered one, the kernel's readahead (8 MiB here, doubled for a
    # sequential file) would cache a small slice anyway, as it does not for the 64 MiB slices of real loads
    monkeypatch.setattr(read_choice, "CANDIDATES", (D8, STREAM, B4))
    shards = [p for p in _evict(ck) if p.endswith(".distcp")]
    if not any(_uncached_pages(p) for p in shards):
        pytest.skip("this file system keeps the pages cached after POSIX_FADV_DONTNEED")
    targets = {k: torch.zeros_like(v) for k, v in sd.items()}
    mmapckpt.load_into(targets, ck)
    for k in sd:
        assert_bitwise_equal(targets[k], sd[k], k)
    dev = os.stat(shards[0]).st_dev
    assert set(read_choice._samples[dev]) == {STREAM, B4}  # the trials ran, and only buffered ways
    assert [_uncached_pages(p) for p in shards] == [0] * len(shards)
