#!/usr/bin/env python3
"""Accelerator benchmark: loading a multi-GB checkpoint to a CUDA GPU, and saving from one.

Measures, in one run and on the same bytes (a transformer-shaped state dict):

- the limits: pinned host-to-device copy bandwidth (``copy_`` from pinned CPU memory,
  non_blocking, then synchronize), a sequential cold read (64 MB reads after
  posix_fadvise DONTNEED) of each checkpoint's own files, and the disk's best cold read of
  the mmapckpt files: one O_DIRECT stream, eight, or four buffered streams (mmapckpt/bench/disk.py);
- loads to the device, warm (page cache hot) and cold (evicted): ``dcp.load`` with
  mmapckpt's MmapReader into preallocated device targets, ``mmapckpt.load_into`` into the
  same targets, ``mmapckpt.load(path, device=...)``, ``load_into`` with the cached files' pages
  registered with the driver (``MMAPCKPT_REGISTER_BYTES=1GiB``, experimental), ``dcp.load`` with the stock
  FileSystemReader, ``safetensors.torch.load_file(device=...)``,
  ``torch.load(mmap=True, weights_only=True)`` then ``.to(device)``, and fastsafetensors
  (``nogds``) where it imports;
- saves from device tensors with MmapWriter and the stock FileSystemWriter (durable: fsync).

Each load is a ratio to its limit: warm to the pinned copy, cold to min(the best cold read:
its files' sequential read or the disk's best way, pinned copy) in bandwidth. mmapckpt's rows are held to targets: warm >= 0.8, cold
>= 0.9. Every load is checked bitwise on the first repetition (the run fails otherwise);
every figure is the median of ``--repeats`` runs, with min and max. A new MmapReader is
made (and closed) per load, as a caller would. An 8 GB run (``--size 8GB --repeats 2``)
takes a few minutes on an H200 host with a fast NVMe disk.

Where the time of mmapckpt's loads goes: each staging pool's counters (the caller's waits for
buffers, the filler's fills and copy launches: io/staging.py) summed per load. After the run,
sweeps of the staging ring's shape (``--staging``: buffers x bytes) and of the fill threads
(``--fill-threads``), warm.

Without a CUDA device it says why and exits with status 2, having measured nothing.
``--device cpu`` is a smoke mode for CI: the same code with CPU targets (staged through the
pipeline, as accelerator targets are) at a tiny size (default 8MB); its ratios mean nothing
and are labelled so.

    python benchmarks/cuda_bench.py --size 4GB --repeats 3 --out cuda_bench.json
    python benchmarks/cuda_bench.py --device cpu --size 8MB --repeats 1 --out smoke.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import warnings
from typing import Any, Callable

import torch

from cuda_common import device_or_exit, stats, timed

#: (key, label, checkpoint it reads) for every load; the first three are mmapckpt's
LOADS = (
    ("mmapckpt-dcp", "dcp.load + MmapReader", "mmapckpt"),
    ("mmapckpt-load_into", "mmapckpt.load_into", "mmapckpt"),
    ("mmapckpt-load", "mmapckpt.load(device=)", "mmapckpt"),
    ("mmapckpt-registered", "load_into, registered pages (1 GiB)", "mmapckpt"),
    ("dcp", "dcp.load + FileSystemReader", "dcp"),
    ("safetensors", "safetensors load_file(device=)", "safetensors"),
    ("torch", "torch.load(mmap=True) + .to(device)", "torch"),
    ("fastsafetensors", "fastsafetensors (nogds)", "safetensors"),
)
TARGET_LOADS = ("mmapckpt-dcp", "mmapckpt-load_into", "mmapckpt-load")
TARGETS = {"warm": 0.8, "cold": 0.9}
SAVES = ("mmapckpt", "dcp")
LIMIT_OF = {"warm": "pinned H2D", "cold": "min(best cold read, pinned H2D)"}
#: (name, streams, O_DIRECT) of the disk's ways read for the cold limit, besides one buffered stream
DISK_WAYS = (("direct_x1", 1, True), ("direct_x8", 8, True), ("buffered_x4", 4, False))
SMOKE_NOTE = ("--device cpu smoke run: CPU targets, an unpinned memcpy as the 'H2D' limit, a tiny size; "
              "the ratios and targets mean nothing, only that every path ran and loaded the right bytes")
StateDict = dict[str, torch.Tensor]










def _h2d_limit(nbytes: int, dev: torch.device) -> float:
    """Seconds to copy as many bytes from one pinned buffer to the device, in 256 MB pieces."""
    piece = min(nbytes, 256 << 20)
    pinned = dev.type == "cuda"
    src = torch.empty(piece, dtype=torch.uint8, pin_memory=pinned)
    dst = torch.empty(piece, dtype=torch.uint8, device=dev)

    def run() -> None:
        done = 0
        while done < nbytes:
            n = min(piece, nbytes - done)
            dst[:n].copy_(src[:n], non_blocking=pinned)
            done += n
    run()  # warm-up: first use of the pinned pages and the copy engine
    return timed(run, dev)[0]


def _fill_limit(files: list[str], threads: int, dev: torch.device) -> float:
    """Seconds to read every byte of the (cached) ``files`` into one staging-sized host buffer (pinned on a
    GPU) with ``threads`` reader threads: the host side of a warm load, with no copy to the device."""
    from mmapckpt.io.reads import ReadJob, pieces, pread_all, submit_reads
    from mmapckpt.io.staging import DEFAULT_STAGING_BYTES

    buf = torch.empty(DEFAULT_STAGING_BYTES, dtype=torch.uint8, pin_memory=dev.type == "cuda").numpy()

    def run() -> None:
        for path in files:
            fd = os.open(path, os.O_RDONLY)
            try:
                size = os.fstat(fd).st_size
                for base in range(0, size, len(buf)):
                    n = min(len(buf), size - base)
                    step = -(-n // threads)
                    step += -step % 4096
                    jobs = [ReadJob(buf[s:min(s + step, n)], base + s, None) for s in range(0, n, step)]
                    if threads == 1:
                        pread_all(fd, pieces(jobs), path)
                    else:
                        for f in submit_reads(fd, jobs, threads=len(jobs), path=path):
                            f.result()
            finally:
                os.close(fd)
    run()
    return timed(run, dev)[0]


def _fill_sweep(ctx: dict[str, Any], counts: list[int], repeats: int) -> dict[str, Any]:
    """For each count of fill threads: the fill limit and the warm ``load_into`` (medians of ``repeats``); and
    whether the warm files probe as cached, since the fill threads serve only files that do."""
    from mmapckpt.bench.system import files_under, warm_up
    from mmapckpt.io import staging

    files, nbytes, default = files_under(ctx["paths"]["mmapckpt"]), ctx["nbytes"], staging.FILL_THREADS
    warm_up(files)
    fsize = sum(os.path.getsize(f) for f in files)
    from mmapckpt.io.files import is_cached

    fd = os.open(max(files, key=os.path.getsize), os.O_RDONLY)
    try:
        cached = is_cached(fd, [0, 1 << 20])
    finally:
        os.close(fd)
    rows = []
    try:
        for t in counts:
            staging.FILL_THREADS = t
            fill = statistics.median(_fill_limit(files, t, ctx["dev"]) for _ in range(repeats))
            load = statistics.median(_load_once(ctx, "mmapckpt-load_into", "warm", check=i == 0)
                                     for i in range(repeats))
            rows.append({"threads": t, "fill_s": fill, "fill_gbps": fsize / fill / 1e9, "load_into_s": load,
                         "load_into_gbps": nbytes / load / 1e9, "default": t == default})
    finally:
        staging.FILL_THREADS = default
    return {"cached_probe": cached, "rows": rows}


def _staging_sweep(ctx: dict[str, Any], shapes: list[tuple[int, int]], repeats: int) -> list[dict[str, Any]]:
    """For each ring shape (buffers, bytes a buffer): a warm ``load_into`` (median of ``repeats``), as a ratio
    to the pinned copy limit, with where its time went (the pool's counters, medians)."""
    import mmapckpt
    from mmapckpt.bench.system import files_under, warm_up
    from mmapckpt.io import staging

    files, rows = files_under(ctx["paths"]["mmapckpt"]), []
    h2d = statistics.median(ctx["h2d"])
    for count, nbytes in shapes:
        warm_up(files)
        times, counters = [], []
        for i in range(repeats):
            if i == 0:
                _scramble(ctx["targets"])
            pools: list[dict[str, Any]] = []
            staging.STATS_HOOK = pools.append
            try:
                times.append(timed(lambda: mmapckpt.load_into(ctx["targets"], ctx["paths"]["mmapckpt"],
                                                               staging_bytes=nbytes, staging_buffers=count),
                                    ctx["dev"])[0])
            finally:
                staging.STATS_HOOK = None
            counters.append({k: sum(p[k] for p in pools) for k in ("wait_s", "fill_s", "issue_s", "buffers")})
            if i == 0:
                _check(ctx["targets"], ctx["sd"], ctx["dev"], f"load_into with {count}x{nbytes} staging")
        med = statistics.median(times)
        rows.append({"buffers": count, "bytes": nbytes, "median_s": med, "gbps": ctx["nbytes"] / med / 1e9,
                     "ratio": h2d / med, "sealed": statistics.median(st["buffers"] for st in counters),
                     **{k: statistics.median(st[k] for st in counters) for k in ("wait_s", "fill_s", "issue_s")},
                     "default": (count, nbytes) == (staging.DEFAULT_STAGING_BUFFERS, staging.DEFAULT_STAGING_BYTES)})
    return rows


def _shapes(text: str) -> list[tuple[int, int]]:
    """'3x32MiB,4x64MiB' -> [(3, 32 MiB), (4, 64 MiB)]."""
    from mmapckpt.bench.synthetic import parse_size

    out = []
    for part in text.split(","):
        count, _, size = part.strip().partition("x")
        out.append((int(count), parse_size(size)))
    return out


# ---------------------------------------------------------------- saves and loads
def _paths(root: str) -> dict[str, str]:
    return {"mmapckpt": os.path.join(root, "mmapckpt"), "dcp": os.path.join(root, "dcp"),
            "safetensors": os.path.join(root, "model.safetensors"), "torch": os.path.join(root, "model.pt")}


def _save_reference_files(sd_cpu: StateDict, paths: dict[str, str]) -> None:
    """The safetensors and torch.save files of the same state dict (untimed: their loads are measured)."""
    from safetensors.torch import save_file

    save_file(sd_cpu, paths["safetensors"])
    torch.save(sd_cpu, paths["torch"])


def _save(method: str, sd: StateDict, path: str) -> None:
    import torch.distributed.checkpoint as dcp

    import mmapckpt

    writer = mmapckpt.MmapWriter(path) if method == "mmapckpt" else dcp.FileSystemWriter(path)
    dcp.save(sd, storage_writer=writer, no_dist=True)


class _Held(dict):
    """Tensors that are views of a loader's buffers, valid until ``close()``."""

    def __init__(self, tensors: StateDict, close: Callable[[], None]) -> None:
        super().__init__(tensors)
        self.close = close


def _fastsafetensors(path: str, dev: torch.device, names: list[str]) -> Callable[[], StateDict] | str:
    """A fastsafetensors load of the safetensors file, or why there is none."""
    try:
        from fastsafetensors import SafeTensorsFileLoader, SingleGroup
    except Exception as e:  # not installed, or built against another torch/CUDA
        return f"skipped: fastsafetensors does not import ({type(e).__name__}: {e})"[:300]

    def load() -> StateDict:
        try:
            loader = SafeTensorsFileLoader(SingleGroup(), dev, nogds=True)
        except (TypeError, AttributeError):  # versions that take the device as a string
            loader = SafeTensorsFileLoader(SingleGroup(), str(dev), nogds=True)
        loader.add_filenames({0: [path]})
        fb = loader.copy_files_to_device()

        def close() -> None:
            fb.close()
            loader.close()
        return _Held({k: fb.get_tensor(k) for k in names}, close)
    return load


def _loads(paths: dict[str, str], targets: StateDict, dev: torch.device,
           names: list[str]) -> tuple[dict[str, Callable[[], StateDict]], dict[str, str]]:
    """Every load as a callable returning the loaded tensors; and notes on those left out."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    import mmapckpt
    from mmapckpt.io.host_register import REGISTER_ENV

    def mmap_dcp() -> StateDict:
        reader = mmapckpt.MmapReader(paths["mmapckpt"])
        reader._stage_cpu_targets = dev.type == "cpu"  # the smoke run: CPU targets through the pipeline
        try:
            dcp.load(targets, storage_reader=reader, no_dist=True)
        finally:
            reader.close()  # frees its pinned staging ring
        return targets

    def load_into() -> StateDict:
        mmapckpt.load_into(targets, paths["mmapckpt"])
        return targets

    def registered() -> StateDict:  # experimental: cached files' pages registered with the driver, 1 GiB at most
        os.environ[REGISTER_ENV] = "1GiB"
        try:
            mmapckpt.load_into(targets, paths["mmapckpt"])
        finally:
            del os.environ[REGISTER_ENV]
        return targets

    def stock() -> StateDict:
        dcp.load(targets, storage_reader=dcp.FileSystemReader(paths["dcp"]), no_dist=True)
        return targets

    def torch_load() -> StateDict:
        return {k: v.to(dev) for k, v in torch.load(paths["torch"], mmap=True, weights_only=True).items()}

    fns: dict[str, Callable[[], StateDict]] = {
        "mmapckpt-dcp": mmap_dcp, "mmapckpt-load_into": load_into, "mmapckpt-registered": registered,
        "mmapckpt-load": lambda: mmapckpt.load(paths["mmapckpt"], device=dev), "dcp": stock,
        "safetensors": lambda: load_file(paths["safetensors"], device=str(dev)), "torch": torch_load}
    notes: dict[str, str] = {}
    fst = _fastsafetensors(paths["safetensors"], dev, names)
    if isinstance(fst, str):
        notes["fastsafetensors"] = fst
    else:
        fns["fastsafetensors"] = fst
    return fns, notes


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _check(out: StateDict, sd: StateDict, dev: torch.device, what: str) -> None:
    """Every tensor on ``dev`` with the reference's dtype, shape and bytes, else the run fails."""
    for k, v in sd.items():
        o = out.get(k)
        same = (isinstance(o, torch.Tensor) and o.device.type == dev.type and o.dtype == v.dtype
                and o.shape == v.shape and torch.equal(_as_bytes(o), _as_bytes(v)))
        if not same:
            raise SystemExit(f"cuda_bench: {what} loaded different bytes for {k!r}")


def _scramble(targets: StateDict) -> None:
    """Overwrite the targets so that a load that skips a tensor cannot pass the check."""
    for t in targets.values():
        t.detach().reshape(-1).view(torch.uint8).fill_(0xA5)  # contiguous: made by empty_like


# ---------------------------------------------------------------- the run
def _load_once(ctx: dict[str, Any], key: str, phase: str, check: bool) -> float | None:
    """One timed load (checked bitwise when ``check``); None where an optional load failed."""
    from mmapckpt.io import staging

    if check:
        _scramble(ctx["targets"])
    pools: list[dict[str, Any]] = []
    staging.STATS_HOOK = pools.append
    try:
        seconds, out = timed(ctx["loads"][key], ctx["dev"])
    except Exception as e:
        if key != "fastsafetensors":
            raise
        ctx["notes"][key] = f"skipped: it failed ({type(e).__name__}: {e})"[:300]
        del ctx["loads"][key]
        return None
    finally:
        staging.STATS_HOOK = None
    if pools:
        ctx["staging"].setdefault(f"{phase} {key}", []).append(
            {k: sum(p[k] for p in pools) for k in ("wait_s", "fill_s", "issue_s", "buffers")} | {"load_s": seconds})
    if check:
        _check(out, ctx["sd"], ctx["dev"], f"{key} ({phase})")
        ctx["checked"][key] = True
    if isinstance(out, _Held):
        out.close()
    return seconds


def _repetition(r: int, ctx: dict[str, Any], add: Callable[[str, str, float], None]) -> None:
    from mmapckpt.bench.system import cold_read_limit, evict, files_under, warm_up

    dev, paths = ctx["dev"], ctx["paths"]
    add("limit", "h2d", _h2d_limit(ctx["nbytes"], dev))
    for m in SAVES:
        shutil.rmtree(paths[m], ignore_errors=True)
        os.sync()  # the removed files' journal commit is not the save's
        add("save", m, timed(lambda m=m: _save(m, ctx["sd"], paths[m]), dev)[0])
    for fmt, p in paths.items():
        add("cold_read", fmt, sum(cold_read_limit(f) for f in files_under(p)))
    from mmapckpt.bench.disk import read_streams

    for name, streams, direct in DISK_WAYS:
        s = read_streams(files_under(paths["mmapckpt"]), streams, direct=direct)
        if s is not None:  # None: the filesystem refuses O_DIRECT
            add("disk", name, s)
    for phase, prep in (("warm", warm_up), ("cold", evict)):
        for key, _label, fmt in LOADS:
            if key in ctx["loads"]:
                prep(files_under(paths[fmt]))
                seconds = _load_once(ctx, key, phase, check=r == 0)
                if seconds is not None:
                    add(phase, key, seconds)


def _measure(sd: StateDict, root: str, repeats: int, dev: torch.device) -> tuple[dict, dict, dict, dict]:
    """Every phase ``repeats`` times: (times by (phase, key), bitwise checks, notes, the run's context)."""
    paths = _paths(root)
    _save_reference_files({k: v.cpu() for k, v in sd.items()}, paths)
    targets = {k: torch.empty_like(v) for k, v in sd.items()}
    loads, notes = _loads(paths, targets, dev, list(sd))
    ctx = {"dev": dev, "sd": sd, "targets": targets, "paths": paths, "loads": loads, "notes": notes,
           "checked": {k: False for k in loads}, "nbytes": sum(t.nbytes for t in sd.values()), "staging": {}}
    times: dict[tuple[str, str], list[float]] = {}
    for r in range(repeats):
        print(f"repetition {r + 1}/{repeats}", file=sys.stderr)
        _repetition(r, ctx, lambda phase, key, s: times.setdefault((phase, key), []).append(s))
    ctx["h2d"] = times[("limit", "h2d")]
    return times, ctx["checked"], notes, ctx


# ---------------------------------------------------------------- the report
def _rows(times: dict[tuple[str, str], list[float]], nbytes: int) -> list[dict[str, Any]]:
    """A row per save and load, each load with its limit (seconds) and its ratio to it (throughput)."""
    h2d = statistics.median(times[("limit", "h2d")])
    disk = [statistics.median(xs) for (p, _), xs in times.items() if p == "disk"]
    fmt_of = {key: fmt for key, _label, fmt in LOADS}
    labels = {key: label for key, label, _fmt in LOADS}
    rows = []
    for (phase, key), xs in times.items():
        if phase not in ("save", "warm", "cold"):
            continue
        limit = None
        if phase == "warm":
            limit = h2d
        elif phase == "cold":
            limit = max(h2d, min([statistics.median(times[("cold_read", fmt_of[key])]), *disk]))
        med = statistics.median(xs)
        label = f"save from device (fsync): {key}" if phase == "save" else labels[key]
        rows.append({"phase": phase, "method": key, "label": label, **stats(xs, nbytes),
                     "limit": LIMIT_OF.get(phase), "limit_s": limit, "ratio": limit / med if limit else None})
    return rows


def _targets(rows: list[dict[str, Any]], meaningful: bool) -> list[dict[str, Any]]:
    return [{"method": r["method"], "phase": r["phase"], "ratio": r["ratio"], "target": TARGETS[r["phase"]],
             "met": r["ratio"] >= TARGETS[r["phase"]], "meaningful": meaningful}
            for r in rows if r["method"] in TARGET_LOADS and r["phase"] in TARGETS]


def _print(doc: dict[str, Any]) -> None:
    print(f"\n{'':<6}{'':<40}{'median s':>9}{'min':>8}{'max':>8}{'GB/s':>7}{'ratio':>7}  of")
    for r in doc["rows"]:
        ratio = f"{r['ratio']:>7.2f}" if r["ratio"] is not None else f"{'':>7}"
        print(f"{r['phase']:<6}{r['label']:<40}{r['median_s']:>9.3f}{r['min_s']:>8.3f}{r['max_s']:>8.3f}"
              f"{r['gbps']:>7.2f}{ratio}  {r['limit'] or ''}")
    h2d = "pinned host-to-device copy" if doc["ratios_meaningful"] else "host memcpy (smoke: stands in for pinned H2D)"
    print(f"\nlimit: {h2d} {doc['limits']['h2d']['gbps']:.2f} GB/s")
    for fmt, s in doc["limits"]["cold_read"].items():
        print(f"limit: sequential cold read of the {fmt} files {s['gbps']:.2f} GB/s")
    for way, s in doc["limits"]["disk"].items():
        print(f"limit: cold read of the mmapckpt files, {way} {s['gbps']:.2f} GB/s")
    if doc.get("staging"):
        print("\nwhere mmapckpt's staged loads spent their time (medians, seconds): the load, the caller's waits for "
              "a free buffer, the filler's fills and copy launches, buffers")
        for key, st in doc["staging"].items():
            print(f"  {key:<26} load {st['load_s']:.3f}  wait {st['wait_s']:.3f}  fill {st['fill_s']:.3f}  "
                  f"issue {st['issue_s']:.3f}  buffers {st['buffers']:.0f}")
    print("\nmmapckpt against the targets" + ("" if doc["ratios_meaningful"] else " (smoke run: meaningless)"))
    for t in doc["targets"]:
        print(f"  {t['phase']:<5} {t['method']:<20} {t['ratio']:.2f} (>= {t['target']}): "
              f"{'met' if t['met'] else 'MISSED'}")
    for key, ok in doc["checked_bitwise"].items():
        print(f"checked bitwise: {key}: {'yes' if ok else 'NO'}")
    if doc.get("fill_sweep"):
        print("\nwarm fill threads (page cache -> one staging buffer, no device copy; then a warm load_into); "
              f"the warm files probe as cached: {doc['fill_sweep']['cached_probe']}")
        for r in doc["fill_sweep"]["rows"]:
            print(f"  {r['threads']:>3} threads{' (default)' if r['default'] else '':<10} fill {r['fill_gbps']:6.2f} GB/s"
                  f"   load_into {r['load_into_gbps']:6.2f} GB/s")
    if doc.get("staging_sweep"):
        print("\nwarm load_into by staging ring (buffers x bytes a buffer), with the pool's counters (medians): the "
              "caller's waits for a free buffer, the filler's fills and its copy launches")
        for r in doc["staging_sweep"]:
            print(f"  {r['buffers']:>2} x {r['bytes'] >> 20:>4} MiB{' (default)' if r['default'] else '':<10} "
                  f"{r['gbps']:6.2f} GB/s  ratio {r['ratio']:.2f}  wait {r['wait_s']:.3f} s  "
                  f"fill {r['fill_s']:.3f} s  issue {r['issue_s']:.3f} s  buffers {r['sealed']:.0f}")
    for key, note in doc["skipped"].items():
        print(f"{key}: {note}")
    if doc.get("note"):
        print(f"note: {doc['note']}")


def _document(args: argparse.Namespace, dev: torch.device, sd: StateDict, times: dict, checked: dict,
              notes: dict, staging: dict[str, list[dict[str, float]]]) -> dict[str, Any]:
    from mmapckpt.bench.system import machine_info

    nbytes, smoke = sum(t.nbytes for t in sd.values()), dev.type == "cpu"
    rows = _rows(times, nbytes)
    return {"device": dev.type, "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None,
            "smoke": smoke, "ratios_meaningful": not smoke, "note": SMOKE_NOTE if smoke else None,
            "machine": machine_info(os.getcwd()), "bytes": nbytes, "tensors": len(sd), "repeats": args.repeats,
            "limits": {"h2d": stats(times[("limit", "h2d")], nbytes),
                       "cold_read": {k: stats(xs, nbytes) for (p, k), xs in times.items() if p == "cold_read"},
                       "disk": {k: stats(xs, nbytes) for (p, k), xs in times.items() if p == "disk"}},
            "rows": rows, "targets": _targets(rows, not smoke), "checked_bitwise": checked, "skipped": notes,
            "staging": {k: {f: statistics.median(x[f] for x in xs) for f in xs[0]} for k, xs in staging.items()}}


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cuda (default), or cpu: a smoke run of the same code, ratios meaningless")
    parser.add_argument("--size", default=None, help="state dict size (default 4GB; 8MB with --device cpu)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write the checkpoints (default: under the cwd)")
    parser.add_argument("--out", default="cuda_bench.json", help="JSON result file")
    parser.add_argument("--staging", default=None,
                        help="comma-separated staging rings (BUFFERSxBYTES) to sweep after the run, warm (default "
                             "3x32MiB,4x32MiB,6x16MiB,4x64MiB,8x8MiB on cuda, 2x1MiB,3x1MiB on cpu; 'none' to skip)")
    parser.add_argument("--fill-threads", default=None,
                        help="comma-separated counts of staging fill threads to sweep after the run, warm "
                             "(default 1,4,8,16 on cuda, 1,2 on cpu; 'none' to skip)")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    dev = device_or_exit(args.device, "cuda_bench")

    from mmapckpt.bench.synthetic import parse_size, transformer_state_dict

    warnings.simplefilter("ignore")
    if dev.type == "cpu":  # the smoke run stages its CPU targets through the pipeline, as accelerator targets are
        from mmapckpt.io import staging

        staging.STAGE_CPU_TARGETS = True
    size = parse_size(args.size or ("8MB" if dev.type == "cpu" else "4GB"))
    sd = {k: v.to(dev) for k, v in transformer_state_dict(size, dtype=getattr(torch, args.dtype)).items()}
    where = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "the CPU (smoke run)"
    print(f"{len(sd)} tensors, {sum(t.nbytes for t in sd.values()) / 1e9:.3f} GB on {where}", file=sys.stderr)
    root = tempfile.mkdtemp(prefix=".mmapckpt-cuda-bench-", dir=args.dir or os.getcwd())
    try:
        times, checked, notes, ctx = _measure(sd, root, args.repeats, dev)
        rings = args.staging or ("2x1MiB,3x1MiB" if dev.type == "cpu" else "3x32MiB,4x32MiB,6x16MiB,4x64MiB,8x8MiB")
        rings_sweep = None if rings == "none" else _staging_sweep(ctx, _shapes(rings), args.repeats)
        counts = args.fill_threads or ("1,2" if dev.type == "cpu" else "1,4,8,16")
        sweep = None if counts == "none" else _fill_sweep(ctx, [int(c) for c in counts.split(",")], args.repeats)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    doc = _document(args, dev, sd, times, checked, notes, ctx["staging"])
    doc["staging_sweep"] = rings_sweep
    doc["fill_sweep"] = sweep
    _print(doc)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=2)
    print(f"\nJSON: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
