"""``mmapckpt bench``: mmapckpt side by side with its alternatives and the machine's limits.

One run builds a transformer-shaped state dict, then, repetition after repetition
(the methods' order rotating so that drift in a shared machine spreads evenly),
measures on the same bytes:

- the limits: ``copy_`` of the tensors into the targets, sequential write+fsync
  (buffered and O_DIRECT), a sequential cold read of as many bytes into one reused
  buffer, and the disk's parallel cold reads (bench/disk.py: several O_DIRECT streams over
  one file and over several, several buffered streams); the best of the reads is the
  cold loads' limit;
- for each method: a durable save, a warm and a cold load into preallocated
  targets, and a lazy open of the whole state dict;
- for each peer loader (bench/peers.py: tensorizer, Run:ai, fastsafetensors, each in a
  process of its own, with the settings its documentation gives for speed): a warm and a
  cold load of a file written once, untimed;

then the many-entry scan's targets (bench/scan.py at ``--scan-entries``, 10,000 tensors),
and once per method, in a fresh process, the memory a load adds. It prints a table
(median seconds with min and max, GB/s, fraction of the limit, ratio to the stock
DCP, what a load returns, whether it reads with O_DIRECT), the targets (bench/targets.py)
and, with ``--out DIR`` only, writes a JSON file there and, with matplotlib (the
``plot`` extra), a PNG chart.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

import torch

from . import report
from .disk import PARTS, SWEEP, read_streams
from .methods import EXTRA_METHODS, METHODS, SCAN_METHODS, Method, lazy_note
from .peers import PEER_KEYS, PEERS, Peer, PeerRun
from .synthetic import parse_size, transformer_state_dict
from .report import write_json
from .system import cold_read_limit, copy_limit, evict, files_under, machine_info, warm_up, write_limit

__all__ = ["add_arguments", "add_common_arguments", "resolve", "drive", "run", "run_benchmark", "write_json",
           "SCAN_TENSORS"]

_QUICK = {"size": "8MB", "tensors": 23, "repeats": 1}
_DEFAULTS = {"size": "1GB", "tensors": 320, "repeats": 5}
StateDict = dict[str, torch.Tensor]


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    """The options every benchmark shares (``mmapckpt bench`` and the scripts in ``benchmarks/``)."""
    parser.add_argument("--size", default=None, help="state dict size, e.g. 256MB, 1GB (default 1GB)")
    parser.add_argument("--dtype", default="bfloat16", help="tensor dtype (default bfloat16)")
    parser.add_argument("--tensors", type=int, default=None,
                        help="about how many tensors (10 per layer plus 3; default 320)")
    parser.add_argument("--repeats", type=int, default=None, help="repetitions; medians shown (default 5)")
    parser.add_argument("--out", default=None,
                        help="directory to write the results to (JSON and, with matplotlib, a PNG chart); "
                             "default: none, the table is printed only")
    parser.add_argument("--dir", default=None,
                        help="where to write the checkpoints (default: a temporary directory under the "
                             "current one, so on its disk rather than a tmpfs /tmp)")
    parser.add_argument("--methods", default=None,
                        help="comma-separated subset of: " + ", ".join(m.key for m in METHODS + EXTRA_METHODS)
                             + ", and the peers " + ", ".join(PEER_KEYS)
                             + " (mmapckpt-base: mmapckpt with O_DIRECT writes and direct reads off; default: "
                             + ",".join([m.key for m in METHODS] + list(PEER_KEYS)) + ")")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads (default: torch's own choice); on a busy machine 1 "
                             "avoids copy_ stalling at OpenMP barriers")
    parser.add_argument("--quick", action="store_true", help="a tiny run (8MB, 1 repetition) to try it out")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``mmapckpt bench`` options to ``parser``."""
    add_common_arguments(parser)
    parser.add_argument("--targets", action="store_true",
                        help="list every target with its measured fraction (default: one line counts them)")
    parser.add_argument("--no-memory", action="store_true", help="skip the per-load memory measurement")
    parser.add_argument("--scan-entries", type=int, default=None, metavar="N",
                        help="the many-entry scan whose targets the comparison reports: N tensors (16 MB) and the "
                             "Adam state dict of --adam-layers (default 10000; 0, and --quick: none)")
    parser.add_argument("--adam-layers", type=int, default=100,
                        help="the many-entry scan's Adam state dict: its model layers, 48 tensors each "
                             "(default 100: 4,800 tensors; 0: no Adam case)")


def resolve(args: argparse.Namespace, default_methods: list[str] | None = None) -> dict[str, Any]:
    """The run's settings from the common options (ValueError on a bad one); ``default_methods``: the
    methods without ``--methods`` (default: every method of the comparison and every peer)."""
    base = _QUICK if args.quick else _DEFAULTS
    dtype = getattr(torch, args.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {args.dtype!r}")
    default = ",".join(default_methods or [m.key for m in METHODS] + list(PEER_KEYS))
    chosen = [s.strip() for s in (args.methods or default).split(",")]
    methods = sorted((m for m in METHODS + EXTRA_METHODS if m.key in chosen), key=lambda m: chosen.index(m.key))
    peers = sorted((p for p in PEERS if p.key in chosen), key=lambda p: chosen.index(p.key))
    if not methods and not peers:
        raise ValueError(f"no known method in {args.methods!r}")
    repeats = args.repeats if args.repeats is not None else base["repeats"]
    if repeats < 1:
        raise ValueError("--repeats must be at least 1")
    tensors = args.tensors if args.tensors is not None else base["tensors"]
    scan_entries = getattr(args, "scan_entries", None)
    return {"size": parse_size(args.size or str(base["size"])), "dtype": dtype, "repeats": repeats,
            "layers": max(1, round((tensors - 3) / 10)), "methods": methods, "peers": peers,
            "scan_entries": scan_entries if scan_entries is not None else (0 if args.quick else SCAN_TENSORS)}


def drive(args: argparse.Namespace, body: Callable[[argparse.Namespace, dict[str, Any], str], int], *,
          prog: str = "mmapckpt bench", default_methods: list[str] | None = None) -> int:
    """Run ``body(args, settings, bench_dir)`` with ``--threads`` torch threads in ``--dir``; 2 on a bad option."""
    try:
        cfg = resolve(args, default_methods)
    except ValueError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    threads_before = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        bench_dir = args.dir or os.getcwd()
        os.makedirs(bench_dir, exist_ok=True)
        return body(args, cfg, bench_dir)
    finally:
        torch.set_num_threads(threads_before)  # run() may be called in a process that goes on


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _same_bits(a: StateDict, b: StateDict) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
        and torch.equal(a[k].contiguous().view(torch.uint8), b[k].contiguous().view(torch.uint8)) for k in a)


class _Run:
    """The measurements of one benchmark run, gathered repetition by repetition."""

    def __init__(self, root: str, sd: StateDict, methods: list[Method], peers: PeerRun | None = None) -> None:
        self.root, self.sd, self.methods, self.peers = root, sd, methods, peers
        self.nbytes = sum(t.nbytes for t in sd.values())
        self.targets = {k: torch.empty_like(v).zero_() for k, v in sd.items()}
        self.times: dict[str, dict[str, list[float]]] = {}
        self.limits: dict[str, list[float]] = {}
        self.correct: dict[str, bool] = {}
        self.notes: list[str] = []
        self.write_paths: dict[str, set[str]] = {}
        self.parts = self._write_parts(PARTS)

    def _write_parts(self, n: int) -> list[str]:
        """The several-files read limit's files: the state dict's size in ``n`` files of random bytes (untimed)."""
        d = os.path.join(self.root, "limit-parts")
        os.makedirs(d)
        paths, left = [], self.nbytes
        for i in range(n):
            size = left // (n - i)
            left -= size
            path = os.path.join(d, f"part-{i:02d}")
            with open(path, "wb") as f:
                f.write(os.urandom(size))
                os.fsync(f.fileno())
            paths.append(path)
        warm_up(paths)  # read once, as every checkpoint is: a freshly written block reads slower the first time
        return paths

    def _add(self, method: str, phase: str, seconds: float) -> None:
        self.times.setdefault(method, {}).setdefault(phase, []).append(seconds)

    def _dir(self, m: Method) -> str:
        return os.path.join(self.root, m.key)

    def copy_limit(self) -> None:
        self.limits.setdefault("copy", []).append(copy_limit(self.sd, self.targets))

    def write_limits(self) -> None:
        """The write limits; leaves limit.bin for the cold-read limits."""
        path = os.path.join(self.root, "limit.bin")
        for name, direct in (("write_buffered", False), ("write_direct", True)):
            t = write_limit(path, self.nbytes, direct=direct)
            if t is not None:
                self.limits.setdefault(name, []).append(t)

    def read_limit(self) -> None:
        """The cold reads of limit.bin and the parts (limit.bin written among the saves, read among the cold loads)."""
        path = os.path.join(self.root, "limit.bin")
        # Read once first, as every checkpoint is by its warm load: on this virtual disk the
        # first read of freshly written blocks was about three times slower than later ones.
        warm_up([path])
        self.limits.setdefault("cold_read", []).append(cold_read_limit(path))
        for name, streams, direct, several in SWEEP:
            t = read_streams(self.parts if several else [path], streams, direct=direct)
            if t is not None:
                self.limits.setdefault(name, []).append(t)
        os.unlink(path)

    def save(self, m: Method) -> None:
        shutil.rmtree(self._dir(m), ignore_errors=True)
        os.sync()  # the removed checkpoint's journal commit (and discards) is not this save's
        t0 = time.perf_counter()
        writer = m.save(self.sd, self._dir(m))
        self._add(m.key, "save", time.perf_counter() - t0)
        path_used = getattr(writer, "write_path", None)
        if path_used:
            self.write_paths.setdefault(m.key, set()).add(str(path_used))

    def load(self, m: Method, phase: str, check: bool) -> None:
        files = files_under(self._dir(m))
        (warm_up if phase == "warm" else evict)(files)
        if check:
            for t in self.targets.values():
                t.zero_()
        self._add(m.key, phase, _timed(lambda: m.load_into(self.targets, self._dir(m))))
        if check:
            self.correct[m.key] = self.correct.get(m.key, True) and _same_bits(self.sd, self.targets)

    def load_peer(self, key: str, phase: str, check: bool) -> None:
        """One peer's load, in its own process; a peer that fails is reported and not run again."""
        peers = self.peers
        if peers is None or key not in peers.workers:
            return
        (warm_up if phase == "warm" else evict)(peers.files(key))
        got = peers.load(key, check)
        if got is None:
            return
        seconds, ok = got
        self._add(key, phase, seconds)
        if ok is not None:
            self.correct[key] = self.correct.get(key, True) and ok

    def lazy(self, m: Method, check: bool) -> None:
        warm_up(files_under(self._dir(m)))
        out: list[StateDict] = []
        self._add(m.key, "lazy", _timed(lambda: out.append(m.lazy(self._dir(m)))))  # type: ignore[misc]
        if check:
            self.correct[m.key] = self.correct.get(m.key, True) and _same_bits(self.sd, dict(out[0]))
        out.clear()

    def repetition(self, r: int) -> None:
        methods = _rotated(self.methods, r)
        loaders: list[Method | str] = _rotated([*self.methods, *(self.peers.active() if self.peers else [])], r)
        # The disk limits take a turn among the methods, at a place that moves each repetition:
        # on a virtual disk whose host caches recent writes, a file's age changes its cold read.
        self.copy_limit()
        slot = r % (len(methods) + 1)
        for i, m in enumerate(methods + [None]):
            if i == slot:
                self.write_limits()
            if m is not None:
                self.save(m)
        for phase in ("warm", "cold"):
            slot = r % (len(loaders) + 1)
            for i, x in enumerate(loaders + [None]):
                if i == slot and phase == "cold":
                    self.read_limit()
                if isinstance(x, Method):
                    self.load(x, phase, check=(r == 0))
                elif x is not None:
                    self.load_peer(x, phase, check=(r == 0))
        note = lazy_note()
        for m in methods:
            if m.lazy is not None and not (m.key == "mmapckpt" and note):
                self.lazy(m, check=(r == 0))
        if note and r == 0:
            self.notes.append(note)

    def memory(self) -> dict[str, dict[str, object]]:
        spec_path = os.path.join(self.root, "spec.json")
        with open(spec_path, "w") as f:
            json.dump({k: [list(v.shape), str(v.dtype).removeprefix("torch.")] for k, v in self.sd.items()}, f)
        out = {}
        for m in self.methods:
            warm_up(files_under(self._dir(m)))
            proc = subprocess.run([sys.executable, "-m", "mmapckpt.bench.memory", m.key, self._dir(m), spec_path],
                                  capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                raise RuntimeError(f"memory measurement of {m.key} failed:\n{proc.stderr[-2000:]}")
            out[m.key] = json.loads(proc.stdout.strip().splitlines()[-1])
        return out


def _rotated(xs: list, r: int) -> list:
    k = r % len(xs) if xs else 0
    return xs[k:] + xs[:k]


#: The many-entry scan's total size in a comparison run.
_SCAN_TENSORS_SIZE = "16MB"


def _scan_targets(bench_dir: str, entries: int, adam_layers: int, dtype: torch.dtype, repeats: int,
                  log: Callable[[str], None]) -> dict[str, Any]:
    """The many-entry scan at ``entries`` tensors (16 MB) and the Adam state dict: its targets."""
    from . import scan as _scan  # torch-heavy planning paths: only when the scan runs

    methods = [m for m in SCAN_METHODS if m != "dcp"]  # the stock DCP takes minutes there and has no target
    doc = _scan.scan("tensors", [entries], fixed=parse_size(_SCAN_TENSORS_SIZE), dtype=dtype,
                     repeats=repeats, methods=methods, bench_dir=bench_dir, log=log, adam_layers=adam_layers,
                     dcp_max_entries=None)
    return {"tensors": entries, "adam_layers": adam_layers, "targets": doc["summary"]["targets"],
            "correct": all(r.get("correct", True) for r in doc["rows"])}


#: The many-entry scan's tensor count in a comparison run.
SCAN_TENSORS = 10_000


def run_benchmark(*, size: int, dtype: torch.dtype, layers: int, repeats: int, methods: list[Method],
                  bench_dir: str, memory: bool = True, log: Callable[[str], None] = print,
                  peers: list[Peer] | None = None, threads: int = 0, scan_entries: int = 0,
                  adam_layers: int = 100) -> dict[str, object]:
    """Run the benchmark in a fresh directory under ``bench_dir``; return the result document.

    ``peers`` run in processes of their own with ``threads`` torch threads (0: torch's choice);
    ``scan_entries`` > 0 adds the many-entry scan's targets at that many tensors (and the Adam
    state dict of ``adam_layers`` layers, 0: none).
    """
    root = tempfile.mkdtemp(prefix=".mmapckpt-bench-", dir=bench_dir)
    peer_run = PeerRun(list(peers or ()), os.path.join(root, "peers"), threads) if peers else None
    try:
        sd = transformer_state_dict(size, dtype=dtype, layers=layers)
        run = _Run(root, sd, methods, peer_run)
        log(f"state dict: {len(sd)} tensors, {run.nbytes / 1e9:.3f} GB of {str(dtype).removeprefix('torch.')}; "
            f"{repeats} repetition(s) in {root}")
        if peer_run is not None:
            log(f"peers: writing their files and starting {len(peer_run.peers)} process(es) ...")
            peer_run.prepare(sd)
        for r in range(repeats):
            log(f"repetition {r + 1}/{repeats} ...")
            run.repetition(r)
        if peer_run is not None:
            peer_run.close()
        mem = run.memory() if memory else {}
        scanned = _scan_targets(root, scan_entries, adam_layers, dtype, repeats, log) if scan_entries > 0 else None
        return report.document(run_info={
            "machine": machine_info(root), "tensors": len(sd), "bytes": run.nbytes,
            "dtype": str(dtype).removeprefix("torch."), "repeats": repeats,
            "write_paths": {k: sorted(v) for k, v in run.write_paths.items()}, "notes": run.notes, "correct": run.correct,
        }, times=run.times, limits=run.limits, memory=mem, methods=[m.key for m in methods],
            peers={"run": peer_run.info, "failed": peer_run.failed,
                   "order": [p.key for p in peer_run.peers]} if peer_run else None,
            direct={m.key: m.direct for m in methods}, scan=scanned)
    finally:
        if peer_run is not None:
            peer_run.close()
        shutil.rmtree(root, ignore_errors=True)


def run(args: argparse.Namespace) -> int:
    """The ``mmapckpt bench`` command: run, print the table, write the JSON (and PNG)."""
    return drive(args, _compare)


def _compare(args: argparse.Namespace, cfg: dict[str, Any], bench_dir: str) -> int:
    doc = run_benchmark(size=cfg["size"], dtype=cfg["dtype"], layers=cfg["layers"], repeats=cfg["repeats"],
                        methods=cfg["methods"], bench_dir=bench_dir, memory=not args.no_memory,
                        log=lambda s: print(s, file=sys.stderr, flush=True), peers=cfg["peers"],
                        threads=args.threads or 0, scan_entries=cfg["scan_entries"], adam_layers=max(0, args.adam_layers))
    print(report.render_table(doc, targets=args.targets))
    if write_json(args.out, "bench.json", doc):
        png = report.plot(doc, os.path.join(args.out, "bench.png"))
        print(f"chart: {png}" if png else "chart: skipped (install the 'plot' extra: matplotlib)")
    scan_ok = doc["scan"] is None or doc["scan"]["correct"]
    return 0 if all(doc["run"]["correct"].values()) and scan_ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mmapckpt bench", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
