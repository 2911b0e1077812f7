"""Processes that load one checkpoint lazily share one copy of its bytes.

Four processes each ``mmapckpt.load`` the same checkpoint and read every page. The
growth of their proportional set sizes (PSS, /proc/PID/smaps_rollup), summed, is
about one checkpoint: each page is mapped four times and counted a quarter in each.
Private copies would sum to four checkpoints.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import helpers
import mmapckpt

N_PROCS = 4
N_TENSORS, TENSOR_BYTES = 16, 4 << 20  # 64 MiB

_CHILD = textwrap.dedent("""
    import sys, torch, mmapckpt
    mmapckpt.load  # the package imports its names on first use: do it before measuring
    torch.zeros(1).sum()
    print("ready", flush=True)
    sys.stdin.readline()
    sd = mmapckpt.load(sys.argv[1])
    print("touched", sum(int(t.view(torch.uint8)[::4096].sum()) for t in sd.values()), flush=True)
    sys.stdin.readline()
""")


def pss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no Pss line for {pid}")


def _expect(proc: subprocess.Popen, word: str) -> str:
    line = proc.stdout.readline()
    if not line.startswith(word):
        raise AssertionError(f"child said {line!r}, expected {word!r}; stderr: {proc.stderr.read()[-2000:]}")
    return line


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/smaps_rollup"), reason="needs Linux /proc/PID/smaps_rollup")
def test_four_processes_share_one_copy(tmp_path):
    g = torch.Generator().manual_seed(1)
    sd = {f"t{i}": torch.randint(0, 256, (TENSOR_BYTES,), dtype=torch.uint8, generator=g) for i in range(N_TENSORS)}
    path = str(tmp_path / "ck")
    helpers.dcp_save(sd, mmapckpt.MmapWriter(path, sync_files=False))
    size = N_TENSORS * TENSOR_BYTES
    procs: list[subprocess.Popen] = []
    try:
        for _ in range(N_PROCS):
            procs.append(subprocess.Popen([sys.executable, "-c", _CHILD, path], stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        for p in procs:
            _expect(p, "ready")
        before = [pss_bytes(p.pid) for p in procs]
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        sums = {_expect(p, "touched") for p in procs}
        after = [pss_bytes(p.pid) for p in procs]
        assert len(sums) == 1  # all four read the same bytes
        grown = sum(a - b for a, b in zip(after, before))
        # One shared copy sums to ~size; private copies would sum to N_PROCS * size.
        assert 0.6 * size < grown < 1.5 * size, (grown, size)
    finally:
        helpers.stop_processes(procs)
