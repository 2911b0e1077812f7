"""Saves of a managed root with ``reuse=``: their time and their bytes on disk, A/B alternately.

    PYTHONPATH=. python benchmarks/dedup_bench.py [--mb 256] [--rounds 5] [--dir /path]

Three saves of one state dict of ``--mb`` MB in 16 MiB float32 tensors, each into a fresh step
directory (``dcp.save`` + ``MmapWriter``, one process, O_DIRECT where the disk takes it), in
alternating order every round:

- ``plain``: a save outside any root (no hashing: what every save without ``reuse`` costs);
- ``changed``: a step of a managed root with ``reuse=[previous step]`` where every tensor changed
  (everything hashed and written: the hashing's cost on a save that finds nothing to refer to);
- ``frozen90``: the same, with 90% of the bytes (the first 90% of the tensors) unchanged since the
  previous step (hashed and referred to; 10% written).

Prints per-round times, the medians, the ratios to ``plain``, each step's bytes on disk, the
process's CPU seconds per save (user + system, every thread), and the load average. The state dicts are built once; a step's "changed" tensors flip between two
versions, so that every save differs from the previous one there.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
import warnings

import torch
import torch.distributed.checkpoint as dcp

from mmapckpt import MmapWriter
from mmapckpt.format.entries import ROOT_MARKER

warnings.filterwarnings("ignore")
TENSOR = 4 << 20  # float32 elements: 16 MiB a tensor


def _states(mb: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    n = max(1, (mb << 20) // (TENSOR * 4))
    g = torch.Generator().manual_seed(0)
    a = [torch.randn(TENSOR, generator=g) for _ in range(n)]
    b = [torch.randn(TENSOR, generator=g) for _ in range(n)]
    return a, b


def _bytes(d: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d) if f.endswith(".distcp"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    a, b = _states(args.mb)
    n = len(a)
    frozen = int(n * 0.9)
    base = tempfile.mkdtemp(prefix="dedup-bench-", dir=args.dir)
    root = os.path.join(base, "root")
    os.makedirs(root)
    with open(os.path.join(root, ROOT_MARKER), "w") as f:
        f.write(json.dumps({"format": "mmapckpt-root", "version": 1}))
    step = 0
    cpu: dict[str, list[float]] = {"plain": [], "changed": [], "frozen90": []}
    prev: dict[str, str] = {}  # kind -> previous step path (its own chain)

    def save(kind: str, r: int) -> tuple[float, int]:
        nonlocal step
        step += 1
        flip = r % 2
        if kind == "frozen90":
            sd = {f"t{i}": (a[i] if i < frozen else (a, b)[flip][i]) for i in range(n)}
        else:
            sd = {f"t{i}": (a, b)[flip][i] for i in range(n)}
        if kind == "plain":
            path, w = os.path.join(base, f"plain-{step}"), None
            w = MmapWriter(path)
        else:
            path = os.path.join(root, f"step-{step}")
            w = MmapWriter(path, overwrite=False, reuse=[prev[kind]] if kind in prev else [])
        t, c = time.perf_counter(), os.times()
        dcp.save(sd, storage_writer=w, no_dist=True)
        dt, c2 = time.perf_counter() - t, os.times()
        cpu[kind].append(c2.user + c2.system - c.user - c.system)
        size = _bytes(path)
        old = prev.get(kind)
        prev[kind] = path
        if kind == "plain":
            shutil.rmtree(path)
        elif old is not None and kind == "changed":
            shutil.rmtree(old)  # nothing refers to it any more
        return dt, size

    kinds = ["plain", "changed", "frozen90"]
    for k in kinds[1:]:  # each chain's first step: written whole (it has nothing to refer to)
        save(k, 1)
    times: dict[str, list[float]] = {k: [] for k in kinds}
    sizes: dict[str, list[int]] = {k: [] for k in kinds}
    loads = []
    for r in range(args.rounds):
        order = kinds if r % 2 == 0 else kinds[::-1]
        for k in order:
            dt, size = save(k, r)
            times[k].append(dt)
            sizes[k].append(size)
        loads.append(os.getloadavg()[0])
        print(f"round {r}: " + ", ".join(f"{k} {times[k][-1]:.3f} s" for k in kinds), flush=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    total = n * TENSOR * 4
    print(f"\n{args.mb} MB state dict ({n} tensors of 16 MiB), {args.rounds} rounds, load average "
          f"{min(loads):.1f}-{max(loads):.1f}")
    for k in kinds:
        print(f"  {k:9s} median {med[k]:.3f} s ({total / med[k] / 1e9:.2f} GB/s), x{med[k] / med['plain']:.3f} of plain; "
              f"bytes written per save {statistics.median(sizes[k]) / total:.3f} of the state dict; "
              f"CPU {statistics.median(cpu[k][-args.rounds:]):.3f} s (user+system, all threads)")
    shutil.rmtree(base)


if __name__ == "__main__":
    main()
