"""A replicated N-rank load, with and without read-once.

``python benchmarks/replicas_bench.py N [--size 128MB] [--repeats 5] [--out DIR] [--dir DIR]``.

One process saves a transformer-shaped state dict (``--size``, default 128MB here) with
MmapWriter; N spawned gloo ranks then each ``dcp.load`` all of it (data-parallel
replicas) through ``MmapReader`` and ``MmapReader(read_once=True)``, alternating, after
one untimed warm-up load of each: from the page cache ("warm") and with the checkpoint's
files evicted from it before each load ("cold", ``posix_fadvise(DONTNEED)``). Reported:
the median wall time of a load (from a barrier before it to a barrier after it, so the
slowest rank's time), and the bytes all ranks read from the checkpoint files
(``bytes_read`` summed) as a multiple of the checkpoint's stored bytes: N x without
read-once, 1.0 x with it. Every load is compared
bit for bit with the saved state dict once.

What the figure means depends on the storage: on a page-cached local file system the
plain loads copy out of memory, so read-once can only add the gloo transfer; on shared
or network storage the bytes avoided are the point (docs/lazy.md, "Read-once loading").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

from mmapckpt.dcp.reader import MmapReader
from mmapckpt.dcp.writer import MmapWriter
from mmapckpt.conversion.progress import human_bytes
from mmapckpt.bench import runner
from mmapckpt.bench.synthetic import parse_size, transformer_state_dict
from mmapckpt.bench.system import evict

__all__ = ["run", "run_replicas", "render", "main"]

PROG = "python benchmarks/replicas_bench.py"

_DEFAULT_SIZE = "128MB"
#: (reader, cache state): "cold" loads start with the checkpoint evicted from the page cache
_MODES = ("plain", "read_once", "plain_cold", "read_once_cold")


def _same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8)) for k in a)


def _rank(rank: int, world: int, init_file: str, path: str, size: int, dtype: torch.dtype, repeats: int,
          out: str) -> None:
    """One replica: time every load, record bytes_read, check each mode's first load."""
    torch.set_num_threads(1)  # N ranks share the machine's cores
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        want = transformer_state_dict(size, dtype=dtype)
        targets = {k: torch.empty_like(v) for k, v in want.items()}
        res: dict[str, Any] = {m: {"seconds": [], "bytes_read": None, "correct": None} for m in _MODES}
        for r in range(repeats + 1):  # r == 0: the warm-up, untimed
            for mode in (_MODES if r % 2 else _MODES[::-1]):
                for t in targets.values():  # every byte a load fails to write shows
                    t.reshape(-1).view(torch.uint8).fill_(0xA5)
                reader = MmapReader(path, read_once=mode.startswith("read_once"))
                if mode.endswith("_cold") and rank == 0:
                    evict(os.path.join(path, n) for n in os.listdir(path))
                dist.barrier()
                t0 = time.perf_counter()
                dcp.load(targets, storage_reader=reader)
                dist.barrier()
                dt = time.perf_counter() - t0
                if r == 0:
                    res[mode]["correct"] = _same_bits(targets, want)
                    res[mode]["bytes_read"] = reader.bytes_read
                else:
                    res[mode]["seconds"].append(dt)
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(res, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_replicas(*, replicas: int, size: int, dtype: torch.dtype, repeats: int, bench_dir: str,
                 log: Any = print) -> dict[str, Any]:
    """Save once, load on ``replicas`` gloo ranks; the figures as a JSON-able dict."""
    with tempfile.TemporaryDirectory(dir=bench_dir, prefix="mmapckpt-replicas-") as tmp:
        path, out = os.path.join(tmp, "ckpt"), os.path.join(tmp, "out")
        os.makedirs(out)
        dcp.save(transformer_state_dict(size, dtype=dtype), storage_writer=MmapWriter(path), no_dist=True)
        stored = sum(i.length for i in MmapReader(path).read_metadata().storage_data.values())
        log(f"saved {human_bytes(stored)}; loading on {replicas} gloo ranks, {repeats} repetitions")
        init_file = os.path.join(tmp, "pg")
        mp.start_processes(_rank, args=(replicas, init_file, path, size, dtype, repeats, out), nprocs=replicas,
                           join=True, start_method="spawn")
        ranks = []
        for r in range(replicas):
            with open(os.path.join(out, f"rank{r}.json")) as f:
                ranks.append(json.load(f))
    rows = {}
    for mode in _MODES:
        secs = [max(rk[mode]["seconds"][i] for rk in ranks) for i in range(repeats)]
        total = sum(rk[mode]["bytes_read"] for rk in ranks)
        rows[mode] = {"median_s": statistics.median(secs), "seconds": secs, "bytes_read_sum": total,
                      "bytes_read_per_rank": [rk[mode]["bytes_read"] for rk in ranks],
                      "x_checkpoint": total / stored if stored else 0.0,
                      "correct": all(rk[mode]["correct"] for rk in ranks)}
    return {"replicas": replicas, "stored_bytes": stored, "dtype": str(dtype).replace("torch.", ""),
            "repeats": repeats, "cpus": os.cpu_count(), "rows": rows}


def render(doc: dict[str, Any]) -> str:
    title = (f"replicated load on {doc['replicas']} gloo ranks, {doc['stored_bytes'] / 1e6:.0f} MB checkpoint, "
             f"medians of {doc['repeats']}")
    lines = [title,
             f"{'reader':<30}{'wall s':>10}{'bytes read (sum)':>20}{'x checkpoint':>14}{'bitwise':>9}"]
    for mode, row in doc["rows"].items():
        name = ("MmapReader(read_once)" if mode.startswith("read_once") else "MmapReader") + \
            (" cold" if mode.endswith("_cold") else " warm")
        lines.append(f"{name:<30}{row['median_s']:>10.3f}{row['bytes_read_sum'] / 1e6:>17.1f} MB"
                     f"{row['x_checkpoint']:>13.2f}x{'yes' if row['correct'] else 'NO':>9}")
    return "\n".join(lines)


def run(args: argparse.Namespace, cfg: dict[str, Any], bench_dir: str) -> int:
    """Run on ``args.replicas`` ranks, print the table, write ``replicas.json`` with ``--out``."""
    if args.replicas < 2:
        print(f"{PROG}: N needs to be at least 2 ranks", file=sys.stderr)
        return 2
    size = parse_size(args.size or _DEFAULT_SIZE)
    doc = run_replicas(replicas=args.replicas, size=size, dtype=cfg["dtype"], repeats=cfg["repeats"],
                       bench_dir=bench_dir, log=lambda s: print(s, file=sys.stderr, flush=True))
    print(render(doc))
    if args.out is not None:  # only where --out says
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, "replicas.json")
        with open(path, "w") as f:
            json.dump(doc, f, indent=2)
        print(f"\nJSON: {path}")
    return 0 if all(r["correct"] for r in doc["rows"].values()) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("replicas", type=int, metavar="N", help="gloo ranks, each loading the whole checkpoint")
    runner.add_common_arguments(parser)
    return runner.drive(parser.parse_args(argv), run, prog=PROG)


if __name__ == "__main__":
    sys.exit(main())
