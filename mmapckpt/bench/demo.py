"""``mmapckpt demo``: the stock DCP and mmapckpt side by side, in under a minute.

It builds a transformer-shaped state dict and, repetition after repetition (the two
methods' order alternating, so that drift on a shared machine falls on both), saves it
durably with ``FileSystemWriter`` and with ``MmapWriter``, then loads each back into
preallocated targets with its reader: warm (the files read once first, so both come
from the page cache; an O_DIRECT save leaves nothing there) and cold (the files evicted
first, as ``mmapckpt bench`` does, and checked with ``mincore``: where the page cache
cannot be dropped, a tmpfs for one, it says so and shows no cold row). Every load of
the first repetition is checked bitwise. It prints each phase's median with its min-max
range, the speed-up with the range of the per-repetition speed-ups, and a verdict that
calls a difference only when the middle half of those speed-ups lies on one side of it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

from .methods import Method, method_by_key
from .synthetic import parse_size, transformer_state_dict
from .system import cached_fraction, evict, files_under, machine_info, warm_up

__all__ = ["add_arguments", "run", "verdict"]

StateDict = dict[str, torch.Tensor]
#: phase -> its label in the table
PHASES = {"save": "save (durable, fsync)", "warm": "load, warm page cache", "cold": "load, cold page cache"}
#: the speed-ups' interquartile range must clear 1 by this much for a verdict other than "about the same"
MARGIN = 0.05
_WARM_LOADS = 2  # warm loads take tens of milliseconds: several per repetition, interleaved


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``mmapckpt demo`` options to ``parser``."""
    parser.add_argument("--size", default="192MB", help="state dict size (default 192MB)")
    parser.add_argument("--repeats", type=int, default=8,
                        help="repetitions (default 8; each saves and loads with both, warm loads twice)")
    parser.add_argument("--dir", default=None,
                        help="where to write the checkpoints (default: a temporary directory under the current "
                             "one, so on its disk rather than a tmpfs /tmp)")


def verdict(ratios: list[float], margin: float = MARGIN) -> str:
    """'faster', 'slower' or 'about the same', from per-repetition speed-ups (stock time / mmapckpt time).

    A difference is called only when the middle half of the speed-ups (Q1..Q3) clears 1 by
    ``margin``, so one disturbed repetition cannot flip it.
    """
    q1, q3 = _quartiles(ratios)
    if q1 >= 1 + margin:
        return "faster"
    if q3 <= 1 - margin:
        return "slower"
    return "about the same"


def _quartiles(xs: list[float]) -> tuple[float, float]:
    if len(xs) < 2:
        return xs[0], xs[0]
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], q[2]


class _Demo:
    def __init__(self, root: str, sd: StateDict, methods: list[Method]) -> None:
        self.root, self.sd, self.methods = root, sd, methods
        self.targets = {k: torch.zeros_like(v) for k, v in sd.items()}
        self.times: dict[tuple[str, str], list[float]] = {}
        self.correct = True
        self.cold_ok: bool | None = None  # None: not known (no mincore)

    def _dir(self, m: Method) -> str:
        return os.path.join(self.root, m.key)

    def _timed(self, m: Method, phase: str, fn) -> None:
        t0 = time.perf_counter()
        fn()
        self.times.setdefault((m.key, phase), []).append(time.perf_counter() - t0)

    def _load(self, m: Method, phase: str, check: bool) -> None:
        if check:
            for t in self.targets.values():
                t.zero_()
        self._timed(m, phase, lambda: m.load_into(self.targets, self._dir(m)))
        if check:
            self.correct &= all(torch.equal(self.sd[k].view(torch.uint8), self.targets[k].view(torch.uint8))
                                for k in self.sd)

    def repetition(self, r: int, cold: bool) -> None:
        order = self.methods if r % 2 == 0 else self.methods[::-1]
        for m in order:
            shutil.rmtree(self._dir(m), ignore_errors=True)
            os.sync()  # the old checkpoint's removal is not this save's cost
            self._timed(m, "save", lambda m=m: m.save(self.sd, self._dir(m)))
        for m in order:
            warm_up(files_under(self._dir(m)))
        for i in range(_WARM_LOADS):
            for m in order:
                self._load(m, "warm", check=(r == 0 and i == 0))
        if not cold:
            return
        for m in order:
            files = files_under(self._dir(m))
            evict(files)
            if r == 0:
                left = cached_fraction(files)
                self.cold_ok = None if left is None else (self.cold_ok is not False and left < 0.5)
            self._load(m, "cold", check=(r == 0))


def _rows(times: dict[tuple[str, str], list[float]], stock: str, ours: str) -> list[dict[str, object]]:
    rows = []
    for phase in PHASES:
        s, m = times.get((stock, phase)), times.get((ours, phase))
        if not s or not m:
            continue
        ratios = [a / b for a, b in zip(s, m)]  # paired: the same repetition, one right after the other
        rows.append({"phase": phase, "stock": s, "mmapckpt": m, "speedup": statistics.median(s) / statistics.median(m),
                     "ratios": ratios, "verdict": verdict(ratios)})
    return rows


def _fmt(xs: list[float]) -> str:
    return f"{statistics.median(xs):7.3f} s ({min(xs):.3f}-{max(xs):.3f})"


def render(rows: list[dict[str, object]]) -> str:
    """The table: medians with min-max, speed-ups with the range over repetitions, and verdicts."""
    head = f"{'':<24}{'stock DCP':<24}{'mmapckpt':<24}speed-up (range over repetitions)"
    lines = [head, f"{'':<24}{'median (min-max)':<24}median (min-max)", "-" * len(head)]
    for r in rows:
        ratios = r["ratios"]
        lines.append(f"{PHASES[r['phase']]:<24}{_fmt(r['stock']):<24}{_fmt(r['mmapckpt']):<24}"  # type: ignore[arg-type]
                     f"{r['speedup']:.2f}x ({min(ratios):.2f}-{max(ratios):.2f})")  # type: ignore[arg-type]
    lines.append("")
    for r in rows:
        q1, q3 = _quartiles(r["ratios"])  # type: ignore[arg-type]
        v = r["verdict"]
        what = "about the same as the stock DCP" if v == "about the same" else f"{v} than the stock DCP"
        lines.append(f"{PHASES[r['phase']]}: mmapckpt is {what} (middle half of the speed-ups {q1:.2f}-{q3:.2f}x)")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """The ``mmapckpt demo`` command; 0 when every load was bitwise equal to the original."""
    if args.repeats < 1:
        print("mmapckpt demo: --repeats must be at least 1", file=sys.stderr)
        return 2
    sd = transformer_state_dict(parse_size(args.size))
    total = sum(t.nbytes for t in sd.values())
    base = args.dir or os.getcwd()
    os.makedirs(base, exist_ok=True)
    root = tempfile.mkdtemp(prefix=".mmapckpt-demo-", dir=base)
    fs = machine_info(root)["filesystem"]
    print(f"state dict: {len(sd)} tensors, {total / 1e6:.0f} MB bfloat16; {args.repeats} repetitions in {base} "
          f"({fs}), {os.cpu_count()} CPUs", flush=True)
    demo = _Demo(root, sd, [method_by_key("dcp"), method_by_key("mmapckpt")])
    t0 = time.perf_counter()
    try:
        for r in range(args.repeats):
            demo.repetition(r, cold=demo.cold_ok is not False)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if demo.cold_ok is False:
        demo.times = {k: v for k, v in demo.times.items() if k[1] != "cold"}
    print(render(_rows(demo.times, "dcp", "mmapckpt")))
    if demo.cold_ok is False:
        print(f"cold load: not shown: the page cache could not be dropped for files under {base} ({fs}): "
              "evicted files stayed cached; use --dir on a disk-backed file system")
    elif demo.cold_ok is None:
        print("cold load: whether the page cache was dropped could not be checked (no mincore here)")
    print(f"\nbitwise equal to the original: {'yes' if demo.correct else 'NO'}; "
          f"{time.perf_counter() - t0:.0f} s; `mmapckpt bench` compares more methods against this machine's limits")
    return 0 if demo.correct else 1
