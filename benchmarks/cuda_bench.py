#!/usr/bin/env python3
"""Accelerator benchmark: loading a multi-GB checkpoint to a CUDA GPU, and saving from one.

Measures, in one run and on the same bytes:

- the limit: pinned host-to-device copy bandwidth (``copy_`` from pinned CPU memory,
  non_blocking, then synchronize);
- load into preallocated GPU targets with ``dcp.load`` + mmapckpt's MmapReader and with
  the stock FileSystemReader, warm (page cache hot) and cold (evicted with
  posix_fadvise DONTNEED), and ``mmapckpt.load(path, device="cuda")``;
- save from GPU tensors with MmapWriter and the stock FileSystemWriter (durable: fsync).

Every figure is the median of ``--repeats`` runs, with min and max. Without a CUDA
device it prints why and exits with status 2, having measured nothing.

    python benchmarks/cuda_bench.py --size 4GB --repeats 3 --out cuda_bench.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from typing import Callable

import torch


def _cuda_or_exit() -> torch.device:
    if not torch.cuda.is_available():
        print("cuda_bench: no CUDA device is available (torch.cuda.is_available() is False; "
              f"torch {torch.__version__}, built with CUDA {torch.version.cuda}). "
              "This benchmark needs an NVIDIA GPU; nothing was measured.", file=sys.stderr)
        sys.exit(2)
    return torch.device("cuda", torch.cuda.current_device())


def _stats(xs: list[float], nbytes: int) -> dict[str, float]:
    med = statistics.median(xs)
    return {"median_s": med, "min_s": min(xs), "max_s": max(xs), "gbps": nbytes / med / 1e9, "n": len(xs)}


def _timed(fn: Callable[[], object], dev: torch.device) -> float:
    torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize(dev)
    return time.perf_counter() - t0


def _h2d_limit(sd: dict[str, torch.Tensor], dev: torch.device) -> float:
    """Seconds to copy the same bytes from one pinned buffer to the device, in 256 MB pieces."""
    nbytes = sum(t.nbytes for t in sd.values())
    piece = min(nbytes, 256 << 20)
    src = torch.empty(piece, dtype=torch.uint8).pin_memory()
    dst = torch.empty(piece, dtype=torch.uint8, device=dev)

    def run() -> None:
        done = 0
        while done < nbytes:
            n = min(piece, nbytes - done)
            dst[:n].copy_(src[:n], non_blocking=True)
            done += n
    run()  # warm-up: first use of the pinned pages and the copy engine
    return _timed(run, dev)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="4GB", help="state dict size (default 4GB)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write the checkpoints (default: under the cwd)")
    parser.add_argument("--out", default="cuda_bench.json", help="JSON result file")
    args = parser.parse_args(argv)
    dev = _cuda_or_exit()

    from mmapckpt.bench.system import machine_info
    from mmapckpt.bench.synthetic import parse_size, transformer_state_dict

    warnings.simplefilter("ignore")
    sd = {k: v.to(dev) for k, v in transformer_state_dict(parse_size(args.size), dtype=getattr(torch, args.dtype)).items()}
    nbytes = sum(t.nbytes for t in sd.values())
    print(f"{len(sd)} tensors, {nbytes / 1e9:.2f} GB on {torch.cuda.get_device_name(dev)}", file=sys.stderr)
    root = tempfile.mkdtemp(prefix=".mmapckpt-cuda-bench-", dir=args.dir or os.getcwd())
    try:
        times = _measure(sd, root, args.repeats, dev)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    rows = _report(times, nbytes)
    doc = {"machine": machine_info(os.getcwd()), "gpu": torch.cuda.get_device_name(dev), "bytes": nbytes,
           "tensors": len(sd), "repeats": args.repeats, "rows": rows}
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=2)
    print(f"\nJSON: {args.out}")
    return 0


def _measure(sd: dict[str, torch.Tensor], root: str, repeats: int, dev: torch.device) -> dict[str, list[float]]:
    """Every phase ``repeats`` times; the loads are checked bitwise on the first repetition."""
    import torch.distributed.checkpoint as dcp

    import mmapckpt
    from mmapckpt.bench.system import evict, files_under, warm_up

    targets = {k: torch.empty_like(v) for k, v in sd.items()}
    paths = {"mmapckpt": os.path.join(root, "mmapckpt"), "dcp": os.path.join(root, "dcp")}
    writers = {"mmapckpt": lambda p: mmapckpt.MmapWriter(p), "dcp": lambda p: dcp.FileSystemWriter(p)}
    readers = {"mmapckpt": lambda p: mmapckpt.MmapReader(p), "dcp": lambda p: dcp.FileSystemReader(p)}
    times: dict[str, list[float]] = {}

    def add(name: str, seconds: float) -> None:
        times.setdefault(name, []).append(seconds)

    for r in range(repeats):
        print(f"repetition {r + 1}/{repeats}", file=sys.stderr)
        add("limit: pinned host-to-device copy", _h2d_limit(sd, dev))
        for m in ("mmapckpt", "dcp"):
            shutil.rmtree(paths[m], ignore_errors=True)
            add(f"save from GPU (fsync): {m}",
                _timed(lambda: dcp.save(sd, storage_writer=writers[m](paths[m]), no_dist=True), dev))
        for phase, prep in (("warm", warm_up), ("cold", evict)):
            for m in ("mmapckpt", "dcp"):
                prep(files_under(paths[m]))
                add(f"{phase} load into GPU targets: {m}",
                    _timed(lambda: dcp.load(targets, storage_reader=readers[m](paths[m]), no_dist=True), dev))
                if r == 0 and not all(torch.equal(targets[k].view(torch.uint8), sd[k].view(torch.uint8)) for k in sd):
                    raise SystemExit(f"cuda_bench: {m} loaded different bytes ({phase})")
            prep(files_under(paths["mmapckpt"]))
            add(f"{phase} mmapckpt.load(device='cuda')", _timed(lambda: mmapckpt.load(paths["mmapckpt"], device=dev), dev))
    return times


def _report(times: dict[str, list[float]], nbytes: int) -> dict[str, dict[str, float]]:
    """Print the table; return its rows (each with its fraction of the host-to-device limit)."""
    limit = statistics.median(times["limit: pinned host-to-device copy"])
    rows = {name: {**_stats(xs, nbytes), "fraction_of_h2d": limit / statistics.median(xs)} for name, xs in times.items()}
    print(f"\n{'':<44}{'median s':>9}{'min':>8}{'max':>8}{'GB/s':>7}{'of H2D':>8}")
    for name, s in rows.items():
        print(f"{name:<44}{s['median_s']:>9.3f}{s['min_s']:>8.3f}{s['max_s']:>8.3f}{s['gbps']:>7.2f}"
              f"{s['fraction_of_h2d']:>8.2f}")
    return rows


if __name__ == "__main__":
    sys.exit(main())
