"""``mmapckpt demo``: save and load one state dict with the stock DCP and with mmapckpt.

It builds a transformer-shaped state dict, saves it with ``FileSystemWriter`` and
with ``MmapWriter``, loads each back into preallocated targets with its reader,
checks the results bitwise, and prints the median times and the speed-up.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
import warnings
from typing import Callable

import torch
import torch.distributed.checkpoint as dcp

from ..dcp.reader import MmapReader
from ..dcp.writer import MmapWriter
from .synthetic import parse_size, transformer_state_dict

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--size", default="300MB", help="state dict size (default 300MB)")
    parser.add_argument("--repeats", type=int, default=3, help="repetitions per phase; medians are shown")
    parser.add_argument("--dir", default=None, help="where to write the checkpoints (default: a temp dir)")


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)


def run(args: argparse.Namespace) -> int:
    nbytes = parse_size(args.size)
    sd = transformer_state_dict(nbytes)
    total = sum(t.nbytes for t in sd.values())
    print(f"state dict: {len(sd)} tensors, {total / 1e6:.0f} MB bf16; {args.repeats} repetitions, medians shown")
    root = tempfile.mkdtemp(prefix="mmapckpt-demo-", dir=args.dir)
    methods = {
        "stock DCP": (lambda p: dcp.FileSystemWriter(p), lambda p: dcp.FileSystemReader(p)),
        "mmapckpt": (lambda p: MmapWriter(p), lambda p: MmapReader(p)),
    }
    times: dict[tuple[str, str], list[float]] = {}
    ok = True
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for _ in range(args.repeats):
                for name, (make_writer, make_reader) in methods.items():
                    path = f"{root}/{name.replace(' ', '_')}"
                    times.setdefault((name, "save"), []).append(
                        _timed(lambda: dcp.save(sd, storage_writer=make_writer(path), no_dist=True)))
                    targets = {k: torch.zeros_like(v) for k, v in sd.items()}
                    times.setdefault((name, "load"), []).append(
                        _timed(lambda: dcp.load(targets, storage_reader=make_reader(path), no_dist=True)))
                    ok &= _same_bits(sd, targets)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"\n{'phase':<28}{'stock DCP':>12}{'mmapckpt':>12}{'speed-up':>10}")
    for phase, label in (("save", "save (fsync)"), ("load", "load into targets (warm)")):
        s = statistics.median(times[("stock DCP", phase)])
        m = statistics.median(times[("mmapckpt", phase)])
        print(f"{label:<28}{s:>11.3f}s{m:>11.3f}s{s / m:>9.2f}x")
    print(f"\nbitwise equal to the original: {'yes' if ok else 'NO'}")
    return 0 if ok else 1
