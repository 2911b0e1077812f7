"""``mmapckpt bench --fresh``: every load in a new process, the library's import included.

What a user mostly sees is not a median inside a long-lived process but a new one (an
inference server starting, a job resuming, a script) that imports the library and loads once
from a cold page cache, then another that loads again from the page cache the first left.
So each method and peer here runs in its own new process (bench/fresh_child.py), timed from
``import torch`` done and its targets allocated to every byte in place (new tensors and views
touched, one byte a page): first with the files it reads evicted (fsync, then
``posix_fadvise(DONTNEED)``, as bench/system.py's ``evict``), then in a second new process
with the page cache as the first left it. The limit is measured the same way in the same
run: a read of the checkpoint's bytes into fresh memory in a new process, first and second.
Each row is the median of ``--repeats``, the methods' order rotating and reversing from one
repetition to the next so that no method always follows the same one; every load is checked
bit for bit in its child. Then, for a checkpoint of ``--open-entries`` tensors (10,000):
``import mmapckpt`` + ``open(path).keys()`` against safetensors' ``safe_open(...).keys()``, and
the ``mmapckpt inspect`` command as a whole process against a process running the latter.

The children import a copy of this mmapckpt in the run's directory whose bytecode was compiled
once before the first of them, as an installed package's is (pip compiles it at install time):
without it, on a machine with ``PYTHONDONTWRITEBYTECODE`` set (or a source tree Python may not
write to), every child would compile the package's source again, about 75 ms of a 50 MB load
here, and time that instead of the import a user pays.
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from . import fresh_report
from .peer_worker import digest
from .peers import PEERS, Peer
from .report import write_json
from .synthetic import parse_size, transformer_state_dict
from .system import cached_fraction, evict, files_under, fsync_path, machine_info

__all__ = ["FreshMethod", "FRESH_METHODS", "FRESH_KEYS", "MANY_ROWS", "add_fresh_arguments", "run", "run_fresh"]

StateDict = dict[str, torch.Tensor]
_CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fresh_child.py")
_QUICK = {"size": "32MB", "tensors": 23, "repeats": 1, "open_entries": 1000}
_DEFAULTS = {"size": "1GB", "tensors": 320, "repeats": 3, "open_entries": 10_000}
#: The longest one child may take before it is killed and its row reported as failed.
_CHILD_TIMEOUT_S = 900


@dataclass(frozen=True)
class FreshMethod:
    """One way of loading, as its child runs it; ``reads``: the file it reads, under the run's directory."""

    key: str
    label: str
    returns: str
    reads: str
    peer: Peer | None = None


_OWN = (
    FreshMethod("load_into", "mmapckpt.load_into", "fill", "ckpt"),
    FreshMethod("dcp_load", "dcp.load + MmapReader (DCP's import timed)", "fill", "ckpt"),
    FreshMethod("load", "mmapckpt.load + touch", "views", "ckpt"),
    FreshMethod("load_model", "mmapckpt.load_model, meta model + touch", "views", "ckpt"),
    FreshMethod("safetensors_load_file", "safetensors load_file + touch", "views", "model.safetensors"),
    FreshMethod("safetensors_safe_open", "safetensors safe_open + copy_", "fill", "model.safetensors"),
    FreshMethod("torch_load", "torch.load(mmap=True) + touch", "views", "model.pt"),
)
#: a peer's family -> (its rows' label, what its load returns); its settings are bench/peers.py's
_PEER_ROWS = {"tensorizer": ("tensorizer TensorDeserializer", "new"),
              "runai": ("Run:ai streamer stream_file + copy_", "fill"),
              "fastsafetensors": ("fastsafetensors get_tensor + touch", "views")}
FRESH_METHODS: tuple[FreshMethod, ...] = _OWN + tuple(
    FreshMethod(p.key, *_PEER_ROWS[p.key.split("-", 1)[0]],
                "model.tensors" if p.key == "tensorizer" else "model.safetensors", p) for p in PEERS)
FRESH_KEYS = tuple(m.key for m in FRESH_METHODS)
#: The limit, run like a method: the checkpoint's bytes read into fresh memory.
_LIMIT = FreshMethod("read", "limit: a read into fresh memory", "fill", "ckpt")
#: The many-entry rows: key -> (label, file, timed in the child or the whole process).
MANY_ROWS: dict[str, tuple[str, str, bool]] = {
    "open_keys": ("import mmapckpt + open(path).keys()", "ckpt", False),
    "safetensors_keys": ("safetensors safe_open(...).keys()", "model.safetensors", False),
    "inspect": ("mmapckpt inspect PATH (the process)", "ckpt", True),
    "safetensors_keys_process": ("python -c safe_open(...).keys() (the process)", "model.safetensors", True),
}


def add_fresh_arguments(parser: argparse.ArgumentParser) -> None:
    """The options only the fresh mode has (the others are ``mmapckpt bench``'s)."""
    parser.add_argument("--fresh", action="store_true",
                        help="every load in a new process, import included, first cold then warm (32MB and one "
                             "repetition with --quick; default 3 repetitions); --methods takes: "
                             + ", ".join(FRESH_KEYS))
    parser.add_argument("--open-entries", type=int, default=None, metavar="N",
                        help="with --fresh: the tensors of the checkpoint whose open().keys() and inspect are timed "
                             "(default 10000; --quick: 1000; 0: none)")


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    base = _QUICK if args.quick else _DEFAULTS
    dtype = getattr(torch, args.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {args.dtype!r}")
    chosen = [s.strip() for s in args.methods.split(",")] if args.methods else list(FRESH_KEYS)
    unknown = [k for k in chosen if k not in FRESH_KEYS]
    if unknown:
        raise ValueError(f"--fresh: unknown method(s) {', '.join(unknown)}; known: {', '.join(FRESH_KEYS)}")
    repeats = args.repeats if args.repeats is not None else base["repeats"]
    if repeats < 1:
        raise ValueError("--repeats must be at least 1")
    tensors = args.tensors if args.tensors is not None else base["tensors"]
    entries = args.open_entries if args.open_entries is not None else base["open_entries"]
    return {"size": parse_size(args.size or str(base["size"])), "dtype": dtype, "repeats": repeats,
            "layers": max(1, round((tensors - 3) / 10)), "open_entries": max(0, entries),
            "methods": [m for m in FRESH_METHODS if m.key in chosen]}


def _order(xs: list, r: int) -> list:
    """Repetition ``r``'s order: reversed on odd ones, then rotated by ``r``, so that no item always follows the
    same one and each repetition starts with another."""
    base = xs[::-1] if r % 2 else list(xs)
    k = r % len(base) if base else 0
    return base[k:] + base[:k]


def _write(work: str, sd: StateDict, formats: set[str]) -> None:
    """The checkpoints every row reads (untimed), durable, and the spec the children check against."""
    from safetensors.torch import save_file

    from ..saving import save

    os.makedirs(work, exist_ok=True)
    save(sd, os.path.join(work, "ckpt"))
    written = []
    if "model.safetensors" in formats or "model.tensors" in formats:
        save_file(sd, os.path.join(work, "model.safetensors"))
        written.append(os.path.join(work, "model.safetensors"))
    if "model.pt" in formats:
        torch.save(sd, os.path.join(work, "model.pt"))
        written.append(os.path.join(work, "model.pt"))
    for p in written:
        fsync_path(p)
    import hashlib

    h = hashlib.blake2b(digest_size=16)
    for p in files_under(os.path.join(work, "ckpt")):
        with open(p, "rb") as f:
            while chunk := f.read(64 << 20):
                h.update(chunk)
    spec = {"tensors": {k: [list(v.shape), str(v.dtype).removeprefix("torch."), digest(v)] for k, v in sd.items()},
            "files_digest": h.hexdigest()}
    with open(os.path.join(work, "spec.json"), "w") as f:
        json.dump(spec, f)


#: the directory holding this mmapckpt
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(_CHILD)))


def _install_copy(site: str) -> str:
    """Copy this mmapckpt into ``site`` (the children's ``PYTHONPATH``) and compile its bytecode there, as pip
    does at install time; return what the run's JSON says of it."""
    dst = os.path.join(site, "mmapckpt")
    shutil.copytree(os.path.join(_ROOT, "mmapckpt"), dst, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    ok = compileall.compile_dir(dst, quiet=1)
    return f"a copy with its bytecode compiled once ({dst})" if ok else "a copy, compiled by each child (compileall failed)"


def _env(threads: int, peer: Peer | None, site: str | None = None) -> dict[str, str]:
    env = {**os.environ, **(peer.env if peer else {})}
    env["PYTHONPATH"] = os.pathsep.join(x for x in (site or _ROOT, env.get("PYTHONPATH")) if x)
    env["MMAPCKPT_BENCH_THREADS"] = str(threads)
    return env


def _last_json(stdout: str) -> dict[str, Any] | None:
    lines = [ln for ln in stdout.splitlines() if ln.strip()]
    try:
        return json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        return None


def _child(what: str, work: str, env: dict[str, str]) -> dict[str, Any]:
    """Run one child to its end and return its answer (``{"error": ...}`` when it gave none)."""
    try:
        proc = subprocess.run([sys.executable, "-P", _CHILD, what, work], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env, timeout=_CHILD_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:  # subprocess.run kills and reaps it
        return {"error": f"failed: no answer in {_CHILD_TIMEOUT_S} s (killed)"}
    got = _last_json(proc.stdout)
    if got is None:
        tail = [ln for ln in proc.stderr.splitlines() if ln.strip()][-1:] or ["no output"]
        return {"error": f"failed: its process ended (exit status {proc.returncode}) without an answer: {tail[0]}"}
    return got


def _process(argv: list[str], env: dict[str, str], check: Callable[[str], bool]) -> dict[str, Any]:
    """A whole process, timed from its start to its exit (Python's start and every import included); its CPU
    seconds from the resources of the children this process reaped (it alone, reaped meanwhile)."""
    r0, t0 = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    try:
        proc = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                              timeout=_CHILD_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        return {"error": f"failed: no answer in {_CHILD_TIMEOUT_S} s (killed)"}
    seconds, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        return {"error": f"failed: exit status {proc.returncode}: {proc.stderr.strip()[-200:]}"}
    cpu = r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime
    return {"s": seconds, "cpu_s": cpu, "sys_s": r1.ru_stime - r0.ru_stime, "ok": check(proc.stdout), "bad": []}


class _Fresh:
    """The measurements of one fresh-process run."""

    def __init__(self, work: str, threads: int, site: str | None = None) -> None:
        self.work, self.threads, self.site = work, threads, site
        self.times: dict[str, dict[str, list[float]]] = {}
        self.cpu: dict[str, dict[str, list[float]]] = {}  # the same repetitions' CPU seconds (process_time)
        self.sys: dict[str, dict[str, list[float]]] = {}  # and the system part of them
        self.cached: dict[str, list[float]] = {}
        self.ok: dict[str, bool] = {}
        self.skipped: dict[str, str] = {}
        self.failed: dict[str, str] = {}

    def files(self, reads: str, d: str) -> list[str]:
        path = os.path.join(d, reads)
        return files_under(path) if os.path.isdir(path) else [path]

    def pair(self, key: str, run: Callable[[], dict[str, Any]], files: list[str], peer: bool) -> None:
        """The first load (its files evicted), then the second (the page cache as the first left it)."""
        if key in self.skipped or key in self.failed:
            return
        evict(files)
        for phase in ("first", "second"):
            got = run()
            if "error" in got:
                (self.skipped if peer else self.failed)[key] = got["error"].splitlines()[0]
                return
            self.times.setdefault(key, {}).setdefault(phase, []).append(got["s"])
            self.cpu.setdefault(key, {}).setdefault(phase, []).append(got["cpu_s"])
            self.sys.setdefault(key, {}).setdefault(phase, []).append(got["sys_s"])
            self.ok[key] = self.ok.get(key, True) and bool(got["ok"])
            if not got["ok"]:
                self.failed.setdefault(key, f"wrong data in {', '.join(got['bad']) or 'the bytes read'}")
            if phase == "first":
                frac = cached_fraction(files)
                if frac is not None:
                    self.cached.setdefault(key, []).append(frac)

    def load(self, m: FreshMethod) -> None:
        env = _env(self.threads, m.peer, self.site)
        self.pair(m.key, lambda: _child(m.key, self.work, env), self.files(m.reads, self.work),
                  m.peer is not None)

    def many(self, key: str, d: str, names: list[str]) -> None:
        _label, reads, whole = MANY_ROWS[key]
        env = _env(self.threads, None, self.site)
        if not whole:
            run = lambda: _child(key, d, env)  # noqa: E731
        elif key == "inspect":
            run = lambda: _process([sys.executable, "-m", "mmapckpt", "inspect", os.path.join(d, "ckpt")], env,  # noqa: E731
                                   lambda out: set(names) <= set(out.split()))
        else:
            code = ("import sys; from safetensors import safe_open\n"
                    "with safe_open(sys.argv[1], framework='pt') as f: print(len(list(f.keys())))")
            run = lambda: _process([sys.executable, "-c", code, os.path.join(d, "model.safetensors")], env,  # noqa: E731
                                   lambda out: out.split() == [str(len(names))])
        self.pair(key, run, self.files(reads, d), peer=False)


def _many_state_dict(n: int, dtype: torch.dtype) -> StateDict:
    """``n`` small tensors (16 MB in all, as the in-process bench's many-entry scan)."""
    per = max(1, parse_size("16MB") // n // torch.empty((), dtype=dtype).element_size())
    gen = torch.Generator().manual_seed(1)
    return {f"layers.{i // 10}.t{i % 10}.weight": torch.randn(per, generator=gen).to(dtype) for i in range(n)}


def run_fresh(cfg: dict[str, Any], bench_dir: str, *, threads: int = 0,
              log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the fresh-process benchmark in a new directory under ``bench_dir``; return the result document."""
    from .. import _version

    root = tempfile.mkdtemp(prefix=".mmapckpt-fresh-", dir=bench_dir)
    load_before = os.getloadavg()
    try:
        sd = transformer_state_dict(cfg["size"], dtype=cfg["dtype"], layers=cfg["layers"])
        nbytes = sum(t.nbytes for t in sd.values())
        work = os.path.join(root, "load")
        _write(work, sd, {m.reads for m in cfg["methods"]})
        log(f"fresh processes: {len(sd)} tensors, {nbytes / 1e9:.3f} GB; {cfg['repeats']} repetition(s) in {root}")
        site = os.path.join(root, "site")
        bytecode = _install_copy(site)
        run = _Fresh(work, threads, site)
        if any(m.key == "tensorizer" for m in cfg["methods"]):
            got = _child("setup-tensorizer", work, _env(threads, None, site))
            if "error" in got:
                run.skipped["tensorizer"] = got["error"]
        items = [_LIMIT, *cfg["methods"]]
        orders = []
        for r in range(cfg["repeats"]):
            order = _order(items, r)
            orders.append([m.key for m in order])
            log(f"repetition {r + 1}/{cfg['repeats']}: {', '.join(orders[-1])}")
            for m in order:
                run.load(m)
        entries = cfg["open_entries"]
        if entries:
            many = _many_state_dict(entries, cfg["dtype"])
            d = os.path.join(root, "many")
            _write(d, many, {"model.safetensors"})
            names = list(many)
            for r in range(cfg["repeats"]):
                log(f"many entries ({entries} tensors), repetition {r + 1}/{cfg['repeats']}")
                for key in _order(list(MANY_ROWS), r):
                    run.many(key, d, names)
        info = {"machine": machine_info(root), "tensors": len(sd), "bytes": nbytes,
                "dtype": str(cfg["dtype"]).removeprefix("torch."), "repeats": cfg["repeats"], "orders": orders,
                "load_average_before": list(load_before), "load_average_after": list(os.getloadavg()),
                "version": _version.__version__, "open_entries": entries, "bytecode": bytecode,
                "read_choice_state": os.environ.get("MMAPCKPT_READ_CHOICE") or "default (the user's cache directory)"}
        return fresh_report.document(info=info, times=run.times, cpu=run.cpu, system=run.sys, cached=run.cached,
                                     ok=run.ok, skipped=run.skipped,
                                     failed=run.failed, methods=[_LIMIT, *cfg["methods"]], many=MANY_ROWS)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def run(args: argparse.Namespace) -> int:
    """The ``mmapckpt bench --fresh`` command: run, print the table, write the JSON."""
    try:
        cfg = _settings(args)
    except ValueError as e:
        print(f"mmapckpt bench: {e}", file=sys.stderr)
        return 2
    bench_dir = args.dir or os.getcwd()
    os.makedirs(bench_dir, exist_ok=True)
    doc = run_fresh(cfg, bench_dir, threads=args.threads or 0, log=lambda s: print(s, file=sys.stderr, flush=True))
    print(fresh_report.render_table(doc))
    write_json(args.out, "bench_fresh.json", doc)
    return 0 if doc["ok"] else 1
