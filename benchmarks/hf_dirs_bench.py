"""``dcp.load`` from a Hugging Face safetensors directory, MmapReader against torch's reader.

``python benchmarks/hf_dirs_bench.py [--size 256MB] [--repeats 9] [--threads 1] [--out DIR]``.

How training starts from Hugging Face weights (torchtitan): ``dcp.load(state_dict,
storage_reader=HuggingFaceStorageReader(hf_dir))``. One run writes a transformer-shaped state
dict once with ``HuggingFaceStorageWriter`` (several files and ``model.safetensors.index.json``,
as downloaded from the Hub), then, repetition after repetition (the readers' order rotating),
loads the same files into the same preallocated targets, warm (pages cached) and cold
(evicted), with:

- ``mmapckpt``: ``MmapReader`` (headers parsed into DCP metadata, chunks mapped, read or copied);
- ``mmapckpt-fast``: the same with ``FastLoadPlanner``;
- ``hf-stock``: torch's ``HuggingFaceStorageReader`` (``safe_open(...).get_slice`` and ``copy_``);
- ``plan`` and ``plan-fast``: ``MmapReader`` metadata with a ``read_data`` that resolves and
  commits every item without reading, with DCP's default planner and with ``FastLoadPlanner``:
  DCP's own planning cost and the header parse, reported apart. A reader's own cost is its
  warm load less its planner's (``hf-stock`` less ``plan``: its own ``read_metadata`` included).

Each reader's first load is checked bit for bit against the state dict. The table gives median
seconds (min-max), GB/s, the fraction of the run's ``copy_`` limit (warm) or cold sequential
read limit (cold), and the ratio to ``hf-stock``.
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
from typing import Any, Callable

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint.planner import LoadItemType
from torch.futures import Future

from mmapckpt.dcp.fast_planner import FastLoadPlanner
from mmapckpt.dcp.reader import MmapReader
from mmapckpt.format.entries import paused_gc
from mmapckpt.bench import runner
from mmapckpt.bench.synthetic import transformer_state_dict
from mmapckpt.bench.system import cold_read_limit, copy_limit, evict, files_under, machine_info, warm_up, write_limit

__all__ = ["READERS", "run", "run_hf_dirs", "render", "main"]

PROG = "python benchmarks/hf_dirs_bench.py"

StateDict = dict[str, torch.Tensor]
#: files the directory is split into (by tensor, round robin), as a Hub download of a few GB is
FILES = 4


class _PlanOnly(MmapReader):
    """MmapReader whose ``read_data`` resolves and commits every item without reading: DCP's planning alone."""

    def read_data(self, plan, planner):  # type: ignore[no-untyped-def]
        with paused_gc():
            for item in plan.items:
                if item.type != LoadItemType.BYTE_IO:
                    planner.commit_tensor(item, planner.resolve_tensor(item))
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut


def _load(reader: Callable[[str], Any], planner: Callable[[], Any] | None = None) -> Callable[[StateDict, str], None]:
    def go(targets: StateDict, path: str) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(targets, storage_reader=reader(path), planner=planner() if planner else None, no_dist=True)
    return go


#: key -> (label, load into targets from the directory, whether it copies the data)
READERS: dict[str, tuple[str, Callable[[StateDict, str], None], bool]] = {
    "mmapckpt": ("dcp.load, MmapReader", _load(MmapReader), True),
    "mmapckpt-fast": ("dcp.load, MmapReader, FastLoadPlanner", _load(MmapReader, FastLoadPlanner), True),
    "hf-stock": ("dcp.load, HuggingFaceStorageReader", _load(HuggingFaceStorageReader), True),
    "plan": ("dcp.load, no-copy reader (DCP planning + headers)", _load(_PlanOnly), False),
    "plan-fast": ("dcp.load, no-copy reader, FastLoadPlanner", _load(_PlanOnly, FastLoadPlanner), False),
}
#: each reader's planning, measured by the no-copy reader with its planner
PLANNING = {"mmapckpt": "plan", "mmapckpt-fast": "plan-fast", "hf-stock": "plan"}


def _write(sd: StateDict, path: str) -> None:
    mapping = {k: 1 + i % FILES for i, k in enumerate(sd)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, storage_writer=HuggingFaceStorageWriter(path, fqn_to_index_mapping=mapping), no_dist=True)


def _same_bits(a: StateDict, b: StateDict) -> bool:
    return all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)


def run_hf_dirs(*, size: int, dtype: torch.dtype, layers: int, repeats: int, bench_dir: str,
                log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the comparison in a fresh directory under ``bench_dir``; return the result document."""
    root = tempfile.mkdtemp(prefix=".mmapckpt-bench-hf-", dir=bench_dir)
    try:
        sd = transformer_state_dict(size, dtype=dtype, layers=layers)
        nbytes = sum(t.nbytes for t in sd.values())
        hf = os.path.join(root, "hf")
        _write(sd, hf)
        files = [p for p in files_under(hf) if p.endswith(".safetensors")]
        log(f"state dict: {len(sd)} tensors, {nbytes / 1e9:.3f} GB in {len(files)} safetensors files; "
            f"{repeats} repetition(s) in {root}")
        targets = {k: torch.empty_like(v).zero_() for k, v in sd.items()}
        times: dict[str, dict[str, list[float]]] = {k: {"warm": [], "cold": []} for k in READERS}
        limits: dict[str, list[float]] = {"copy": [], "cold_read": []}
        correct: dict[str, bool] = {}
        keys = list(READERS)
        limit_file = os.path.join(root, "limit.bin")
        for r in range(repeats):
            log(f"repetition {r + 1}/{repeats} ...")
            order = keys[r % len(keys):] + keys[:r % len(keys)]
            limits["copy"].append(copy_limit(sd, targets))
            write_limit(limit_file, nbytes, direct=False)
            warm_up([limit_file])
            limits["cold_read"].append(cold_read_limit(limit_file))
            os.unlink(limit_file)
            for phase in ("warm", "cold"):
                for key in order:
                    _, load, copies = READERS[key]
                    (warm_up if phase == "warm" else evict)(files)
                    check = r == 0 and phase == "warm" and copies
                    if check:
                        for t in targets.values():
                            t.zero_()
                    t0 = time.perf_counter()
                    load(targets, hf)
                    times[key][phase].append(time.perf_counter() - t0)
                    if check:
                        correct[key] = _same_bits(sd, targets)
        return {"run": {"machine": machine_info(root), "tensors": len(sd), "bytes": nbytes, "files": len(files),
                        "dtype": str(dtype).removeprefix("torch."), "repeats": repeats, "correct": correct},
                "times": times, "limits": limits, "labels": {k: v[0] for k, v in READERS.items()}}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _med(xs: list[float]) -> float:
    return statistics.median(xs)


def render(doc: dict[str, Any]) -> str:
    """The result table: per reader and phase, median s (min-max), GB/s, fraction of the limit, ratio to hf-stock."""
    run, times, limits = doc["run"], doc["times"], doc["limits"]
    gb = run["bytes"] / 1e9
    lim = {"warm": _med(limits["copy"]), "cold": _med(limits["cold_read"])}
    lines = [f"dcp.load from a Hugging Face directory: {run['tensors']} tensors, {gb:.3f} GB of {run['dtype']} in "
             f"{run['files']} files, {run['repeats']} repetition(s), medians",
             f"limits: copy_ {gb / lim['warm']:.2f} GB/s (warm), cold sequential read {gb / lim['cold']:.2f} GB/s",
             f"{'reader':52} {'phase':5} {'median s (min-max)':>24} {'GB/s':>6} {'of limit':>8} {'vs hf-stock':>11}"]
    for key, label in doc["labels"].items():
        for phase in ("warm", "cold"):
            xs = times[key][phase]
            m = _med(xs)
            ratio = _med(times["hf-stock"][phase]) / m
            span = f"{m:.4f} ({min(xs):.4f}-{max(xs):.4f})"
            copies = READERS[key][2] if key in READERS else True
            frac, vs = (f"{lim[phase] / m:.2f}", f"{ratio:.2f}x") if copies else ("-", "-")
            lines.append(f"{label:52} {phase:5} {span:>24} {gb / m:6.2f} {frac:>8} {vs:>11}")
    plan, fast = _med(times["plan"]["warm"]), _med(times["plan-fast"]["warm"])
    lines.append(f"DCP planning and headers (the no-copy reader, warm): {plan:.4f} s, {plan / run['tensors'] * 1e6:.0f} "
                 f"us an entry ({fast / run['tensors'] * 1e6:.0f} us with FastLoadPlanner); the readers' own warm cost "
                 "(load less its planning): " + ", ".join(f"{k} {_med(times[k]['warm']) - _med(times[p]['warm']):.4f} s"
                                                          for k, p in PLANNING.items()))
    bad = [k for k, ok in run["correct"].items() if not ok]
    lines.append("every load checked bit for bit: " + ("ok" if not bad else f"WRONG DATA from {', '.join(bad)}"))
    return "\n".join(lines)


def run(args: argparse.Namespace, cfg: dict[str, Any], bench_dir: str) -> int:
    """Run, print the table, write ``hf-dirs.json`` with ``--out``."""
    doc = run_hf_dirs(size=cfg["size"], dtype=cfg["dtype"], layers=cfg["layers"], repeats=cfg["repeats"],
                      bench_dir=bench_dir, log=lambda s: print(s, file=sys.stderr, flush=True))
    print(render(doc))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, "hf-dirs.json")
        with open(path, "w") as f:
            json.dump(doc, f, indent=2)
        print(f"\nJSON: {path}")
    return 0 if all(doc["run"]["correct"].values()) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    runner.add_common_arguments(parser)
    return runner.drive(parser.parse_args(argv), run, prog=PROG)


if __name__ == "__main__":
    sys.exit(main())
