"""``mmapckpt bench --managed``: saves through ``CheckpointManager`` beside plain saves (issue 45).

Two state dicts of ``--size``, saved step after step:

- *mostly frozen*: 90% of the bytes frozen (a transformer-shaped block that never changes), the
  other 10% changed before every save; saved ``SAVES`` times as steps 1..5 of one managed root
  (unchanged chunks stored once, docs/manager.md), and, alternating with it, the same state
  dict by ``dcp.save`` + ``MmapWriter`` into a fresh directory. Each save's seconds and the bytes it
  added on disk; the second to fifth as fractions of the first (full) managed save.
- *fully changing*: every byte changed before every save; managed saves (each compared with the
  step before, which shares nothing) against plain ones: the median time ratio, which says what
  deduplication costs a normal save (on a local root only the first step is hashed: hash on second sight).

Each save's CPU seconds (this process, every thread: ``time.process_time``) beside its wall time: on a
machine shared with other work the wall time says as much about the others as about the save; what the
save itself costs in hashing shows in its CPU time.

The last managed step of each is loaded (``CheckpointManager.load``) and checked bitwise.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from typing import Any, Callable

import torch

from .synthetic import transformer_state_dict

__all__ = ["SAVES", "FROZEN", "managed_saves", "render"]

#: How many saves each state dict gets.
SAVES = 5
#: The frozen share of the mostly frozen state dict's bytes.
FROZEN = 0.9
StateDict = dict[str, torch.Tensor]


def _disk_bytes(path: str) -> int:
    """The bytes the files under ``path`` take on disk (allocated blocks)."""
    total = 0
    for d, _, names in os.walk(path):
        for n in names:
            total += os.lstat(os.path.join(d, n)).st_blocks * 512
    return total


def _state_dicts(size: int, dtype: torch.dtype, layers: int) -> tuple[StateDict, list[str]]:
    """The mostly frozen state dict and the names of its changing tensors."""
    frozen = transformer_state_dict(int(size * FROZEN), dtype=dtype, layers=layers, seed=0)
    changing = transformer_state_dict(size - int(size * FROZEN), dtype=dtype, layers=max(1, layers // 9), seed=1)
    sd = {f"frozen.{k}": v for k, v in frozen.items()}
    sd.update({f"trained.{k}": v for k, v in changing.items()})
    return sd, [f"trained.{k}" for k in changing]


def _change(sd: StateDict, names: list[str], step: int) -> None:
    """A training step's worth of change: every element of ``names`` gets new bits."""
    gen = torch.Generator().manual_seed(1000 + step)
    for k in names:
        t = sd[k]
        t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype) + step)


def _same_bits(a: StateDict, b: StateDict) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k].contiguous().view(torch.uint8), b[k].contiguous().view(torch.uint8)) for k in a)


def _series(sd: StateDict, names: list[str], root: str, keep_plain: bool) -> dict[str, Any]:
    """``SAVES`` managed saves of ``sd`` (changing ``names`` before each) beside plain ones; the last step's check."""
    import torch.distributed.checkpoint as dcp

    from ..dcp.writer import MmapWriter
    from ..manage.manager import CheckpointManager

    manager = CheckpointManager(os.path.join(root, "managed"), keep_last=None)
    managed, plain = [], []
    for step in range(1, SAVES + 1):
        if step > 1:
            _change(sd, names, step)
        order = ("managed", "plain") if step % 2 else ("plain", "managed")  # alternate: drift spreads evenly
        for kind in order:
            os.sync()  # the previous save's writeback is not this one's
            if kind == "managed":
                before = _disk_bytes(manager.root)
                c0, t0 = time.process_time(), time.perf_counter()
                manager.save(sd, step)
                seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
                managed.append({"step": step, "seconds": seconds, "cpu_seconds": cpu,
                                "bytes_added": _disk_bytes(manager.root) - before})
            else:
                path = os.path.join(root, f"plain-{step}")
                c0, t0 = time.process_time(), time.perf_counter()
                dcp.save(sd, storage_writer=MmapWriter(path), no_dist=True)
                seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
                plain.append({"step": step, "seconds": seconds, "cpu_seconds": cpu, "bytes_added": _disk_bytes(path)})
                if not keep_plain:
                    shutil.rmtree(path)  # untimed: the next plain save goes into a fresh directory
    targets = {k: torch.zeros_like(v) for k, v in sd.items()}
    loaded = manager.load(targets)
    ok = loaded == SAVES and _same_bits(sd, targets)
    return {"managed": managed, "plain": plain, "loaded_step": loaded, "correct": ok}


def managed_saves(*, size: int, dtype: torch.dtype, layers: int, bench_dir: str,
                  log: Callable[[str], None] = print) -> dict[str, Any]:
    """Both series in a fresh directory under ``bench_dir`` (removed after); the result document."""
    root = tempfile.mkdtemp(prefix=".mmapckpt-bench-managed-", dir=bench_dir)
    try:
        sd, names = _state_dicts(size, dtype, layers)
        nbytes = sum(t.nbytes for t in sd.values())
        changing = sum(sd[k].nbytes for k in names)
        tensors = len(sd)
        log(f"managed saves: {len(sd)} tensors, {nbytes / 1e9:.3f} GB, {changing / nbytes:.1%} changing; "
            f"{SAVES} saves in {root}")
        frozen = _series(sd, names, os.path.join(root, "frozen"), keep_plain=False)
        del sd
        log("managed saves: the fully changing state dict ...")
        full_sd = transformer_state_dict(size, dtype=dtype, layers=layers, seed=2)
        full = _series(full_sd, list(full_sd), os.path.join(root, "full"), keep_plain=False)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    first = frozen["managed"][0]
    for row in frozen["managed"]:
        row["time_fraction_of_first"] = row["seconds"] / first["seconds"]
        row["bytes_fraction_of_first"] = row["bytes_added"] / first["bytes_added"]
    for row, p in zip(frozen["managed"], frozen["plain"]):
        row["ratio_to_plain"] = row["seconds"] / p["seconds"]
    ratio = statistics.median(m["seconds"] / p["seconds"] for m, p in zip(full["managed"], full["plain"]))
    cpu_ratio = statistics.median(m["cpu_seconds"] / max(p["cpu_seconds"], 1e-9)
                                  for m, p in zip(full["managed"], full["plain"]))
    later = frozen["managed"][1:]
    return {"bytes": nbytes, "changing_bytes": changing, "tensors": tensors, "dtype": str(dtype).removeprefix("torch."), "saves": SAVES,
            "frozen": frozen, "full": full, "full_ratio_managed_to_plain": ratio,
            "full_cpu_ratio_managed_to_plain": cpu_ratio,
            "later_cpu_fraction_max": max(r["cpu_seconds"] / max(first["cpu_seconds"], 1e-9) for r in later),
            "later_time_fraction_max": max(r["time_fraction_of_first"] for r in later),
            "later_bytes_fraction_max": max(r["bytes_fraction_of_first"] for r in later),
            "correct": frozen["correct"] and full["correct"]}


def render(doc: dict[str, Any]) -> str:
    """The row as a plain-text table."""
    lines = [f"managed saves: {doc['bytes'] / 1e9:.3f} GB {doc['dtype']}, "
             f"{doc['changing_bytes'] / doc['bytes']:.0%} of the bytes changing between saves, {doc['saves']} saves", "",
             f"{'save':<6}{'managed s':>11}{'added':>12}{'time/1st':>10}{'bytes/1st':>11}"
             f"{'plain s':>10}{'added':>12}{'managed/plain':>15}{'cpu s':>8}{'plain cpu':>11}"]
    for m, p in zip(doc["frozen"]["managed"], doc["frozen"]["plain"]):
        lines.append(f"{m['step']:<6}{m['seconds']:>11.3f}{m['bytes_added'] / 2**20:>9.1f}MiB"
                     f"{m['time_fraction_of_first']:>10.3f}{m['bytes_fraction_of_first']:>11.3f}"
                     f"{p['seconds']:>10.3f}{p['bytes_added'] / 2**20:>9.1f}MiB{m['ratio_to_plain']:>15.3f}"
                     f"{m['cpu_seconds']:>8.3f}{p['cpu_seconds']:>11.3f}")
    full = doc["full"]
    lines += ["", "fully changing state dict, managed/plain save time: "
              + ", ".join(f"{m['seconds'] / p['seconds']:.3f}" for m, p in zip(full["managed"], full["plain"]))
              + f" (median {doc['full_ratio_managed_to_plain']:.3f}); CPU time: "
              + ", ".join(f"{m['cpu_seconds'] / max(p['cpu_seconds'], 1e-9):.3f}" for m, p in zip(full["managed"], full["plain"]))
              + f" (median {doc['full_cpu_ratio_managed_to_plain']:.3f})",
              f"bitwise check of the last managed step's load: mostly frozen "
              f"{'ok' if doc['frozen']['correct'] else 'FAILED'}, fully changing {'ok' if full['correct'] else 'FAILED'}"]
    return "\n".join(lines)


def run(args: Any, cfg: dict[str, Any], bench_dir: str) -> int:
    """``mmapckpt bench --managed`` (through runner.drive): the row, its table, ``managed.json`` with ``--out``."""
    import sys

    from .report import write_json

    doc = managed_saves(size=cfg["size"], dtype=cfg["dtype"], layers=cfg["layers"], bench_dir=bench_dir,
                        log=lambda s: print(s, file=sys.stderr, flush=True))
    print(render(doc))
    write_json(args.out, "bench_managed.json", doc)
    return 0 if doc["correct"] else 1
