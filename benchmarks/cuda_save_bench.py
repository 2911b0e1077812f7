#!/usr/bin/env python3
"""Accelerator save benchmark: how long ``dcp.async_save`` blocks the training loop, and durable saves.

Measures, in one run and on the same bytes (a transformer-shaped state dict on the device):

- the limits: the device-to-host copy (every tensor of the state dict copied ``non_blocking``
  into one page-locked host buffer, then one synchronize), and an O_DIRECT write+fsync of as
  many bytes (``mmapckpt.bench.system.write_limit``; a buffered one where O_DIRECT is refused);
- the time ``dcp.async_save(sd, storage_writer=MmapWriter(...))`` blocks its caller (the
  staging of the state dict to the host; the write goes on in the background and is waited
  for, untimed, before the next save) with (a) no stager: DCP's default, a ``DefaultStager``
  with every option off, made per save; (b) DCP's ``DefaultStager(StagingOptions(True, False,
  False, True))`` (pinned, non-blocking copies), made once; (c) ``mmapckpt.PinnedStager``,
  made once. (b) and (c) are given as the first save (their host memory is allocated then)
  and the steady state (median of ``--repeats`` later saves); each as a ratio to the D2H limit
  (limit seconds / blocked seconds; the target for (c)'s steady state is >= 0.8);
- ``dcp.save`` with MmapWriter from the device tensors (durable: fsync), as a ratio to the
  O_DIRECT write (target >= 1.0).

Every staged save is loaded back and compared bitwise once, after the source was changed
right after ``async_save`` returned. A 2 GB run takes well under two minutes on an H100 host.
Without a CUDA device it says why and exits with status 2, having measured nothing.
``--device cpu`` is a smoke mode for CI (default 8MB): CPU tensors, an unpinned memcpy as the
"D2H" limit, no (b) (DCP's pinned stager needs an accelerator); its ratios mean nothing and are
labelled so.

    python benchmarks/cuda_save_bench.py --size 2GB --repeats 3 --out cuda_save_bench.json
    python benchmarks/cuda_save_bench.py --device cpu --size 8MB --repeats 1 --out smoke.json
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

from cuda_common import device_or_exit, stats, sync

#: (key, label) of every blocked-time row; "first" rows are one save, the others medians
BLOCKED = (
    ("dcp-default", "async_save, no stager (DCP's default)"),
    ("dcp-pinned-first", "async_save, DefaultStager(pinned, non_blocking): first"),
    ("dcp-pinned", "async_save, DefaultStager(pinned, non_blocking): steady"),
    ("pinned-stager-first", "async_save, mmapckpt.PinnedStager: first"),
    ("pinned-stager", "async_save, mmapckpt.PinnedStager: steady"),
)
TARGETS = {("blocked", "pinned-stager"): 0.8, ("save", "mmapckpt"): 1.0}
SMOKE_NOTE = ("--device cpu smoke run: CPU tensors, an unpinned memcpy as the 'D2H' limit, a tiny size; "
              "the ratios and targets mean nothing, only that every path ran and saved the right bytes")
StateDict = dict[str, torch.Tensor]








# ---------------------------------------------------------------- limits
def _d2h_limit(sd: StateDict, dev: torch.device, repeats: int) -> list[float]:
    """Seconds to copy every tensor non_blocking into one page-locked buffer (one synchronize), per repeat."""
    from mmapckpt.io.d2h import HostBuffer

    offsets, off = [], 0
    for t in sd.values():
        offsets.append(off)
        off += -(-t.nbytes // 64) * 64
    host = HostBuffer(torch.Size([off]), torch.uint8, dev if dev.type != "cpu" else None).target

    def run() -> float:
        sync(dev)
        t0 = time.perf_counter()
        for o, t in zip(offsets, sd.values()):
            host[o:o + t.nbytes].view(t.dtype).view(t.shape).copy_(t, non_blocking=True)
        sync(dev)
        return time.perf_counter() - t0

    run()  # warm-up: the first touch of the host pages and the copy engine
    return [run() for _ in range(repeats)]


def _write_limit(root: str, nbytes: int, repeats: int) -> tuple[list[float], str]:
    from mmapckpt.bench.system import write_limit

    path = os.path.join(root, "write-limit")
    xs = [write_limit(path, nbytes, direct=True) for _ in range(repeats)]
    label = "O_DIRECT write+fsync"
    if any(x is None for x in xs):  # tmpfs and some network filesystems refuse O_DIRECT
        xs, label = [write_limit(path, nbytes, direct=False) for _ in range(repeats)], "buffered write+fsync"
    os.unlink(path)
    return [float(x) for x in xs if x is not None], label


# ---------------------------------------------------------------- saves
def _check(path: str, want: StateDict) -> bool:
    import torch.distributed.checkpoint as dcp

    from mmapckpt import MmapReader

    got = {k: torch.empty(v.shape, dtype=v.dtype) for k, v in want.items()}
    dcp.load(got, storage_reader=MmapReader(path), no_dist=True)
    return all(torch.equal(got[k].view(-1).view(torch.uint8), want[k].reshape(-1).view(torch.uint8)) for k in want)


def _blocked(sd: StateDict, path: str, stager: Any, dev: torch.device, check: bool) -> tuple[float, bool | None]:
    """Seconds ``dcp.async_save`` blocks; then, untimed, the write is waited for (and checked bitwise)."""
    import torch.distributed.checkpoint as dcp

    from mmapckpt import MmapWriter

    want = {k: v.to("cpu", copy=True) for k, v in sd.items()} if check else None
    shutil.rmtree(path, ignore_errors=True)
    sync(dev)
    t0 = time.perf_counter()
    fut = dcp.async_save(sd, storage_writer=MmapWriter(path), async_stager=stager, no_dist=True)
    seconds = time.perf_counter() - t0
    if check:
        for v in sd.values():  # what training does next; the save must not see it
            v.view(torch.uint8).bitwise_not_()
    fut.result()
    ok = None
    if want is not None:
        ok = _check(path, want)
        for v in sd.values():
            v.view(torch.uint8).bitwise_not_()  # back to the bytes every other row saves
    shutil.rmtree(path, ignore_errors=True)
    return seconds, ok


def _measure(sd: StateDict, root: str, repeats: int, dev: torch.device) -> tuple[dict, dict, dict]:
    """(times by (phase, key), bitwise checks by key, notes on skipped rows)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    from mmapckpt import MmapWriter, PinnedStager

    nbytes = sum(t.nbytes for t in sd.values())
    times: dict[tuple[str, str], list[float]] = {("limit", "d2h"): _d2h_limit(sd, dev, repeats)}
    checked: dict[str, bool] = {}
    notes: dict[str, str] = {}
    path = os.path.join(root, "ckpt")

    def blocked(key: str, stager: Any, i: int) -> None:
        seconds, ok = _blocked(sd, path, stager, dev, check=i == 0)
        times.setdefault(("blocked", key), []).append(seconds)
        if ok is not None:
            checked[key] = ok

    for i in range(repeats):
        blocked("dcp-default", None, i)
    stagers: list[tuple[str, Callable[[], Any]]] = [("pinned-stager", PinnedStager)]
    if torch.accelerator.is_available():
        stagers.insert(0, ("dcp-pinned", lambda: DefaultStager(StagingOptions(True, False, False, True))))
    else:
        notes["dcp-pinned"] = "skipped: DefaultStager's non_blocking copies need an accelerator"
    for key, make in stagers:
        stager = make()
        try:
            blocked(f"{key}-first", stager, 0)
            for i in range(repeats):
                blocked(key, stager, i + 1)
        finally:
            stager.close()
    limit, label = _write_limit(root, nbytes, repeats)
    times[("limit", "write")] = limit
    notes["write_limit"] = label
    for i in range(repeats):
        shutil.rmtree(path, ignore_errors=True)
        os.sync()  # the removed files' journal commit is not the save's
        sync(dev)
        t0 = time.perf_counter()
        dcp.save(sd, storage_writer=MmapWriter(path), no_dist=True)
        times.setdefault(("save", "mmapckpt"), []).append(time.perf_counter() - t0)
        if i == 0:
            checked["save"] = _check(path, {k: v.cpu() for k, v in sd.items()})
    shutil.rmtree(path, ignore_errors=True)
    return times, checked, notes


# ---------------------------------------------------------------- the report
def _document(args: argparse.Namespace, dev: torch.device, sd: StateDict, times: dict, checked: dict,
              notes: dict) -> dict[str, Any]:
    from mmapckpt.bench.system import machine_info

    nbytes, smoke = sum(t.nbytes for t in sd.values()), dev.type == "cpu"
    d2h = statistics.median(times[("limit", "d2h")])
    write = statistics.median(times[("limit", "write")])
    labels = dict(BLOCKED)
    rows = []
    for (phase, key), xs in times.items():
        if phase == "limit":
            continue
        limit_s, limit = (d2h, "D2H into one pinned buffer") if phase == "blocked" else (write, notes["write_limit"])
        label = labels[key] if phase == "blocked" else "dcp.save + MmapWriter from device (fsync)"
        rows.append({"phase": phase, "method": key, "label": label, **stats(xs, nbytes), "limit": limit,
                     "limit_s": limit_s, "ratio": limit_s / statistics.median(xs)})
    targets = [{"phase": r["phase"], "method": r["method"], "ratio": r["ratio"],
                "target": TARGETS[(r["phase"], r["method"])], "met": r["ratio"] >= TARGETS[(r["phase"], r["method"])],
                "meaningful": not smoke} for r in rows if (r["phase"], r["method"]) in TARGETS]
    return {"device": dev.type, "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None,
            "smoke": smoke, "ratios_meaningful": not smoke, "note": SMOKE_NOTE if smoke else None,
            "machine": machine_info(os.getcwd()), "bytes": nbytes, "tensors": len(sd), "repeats": args.repeats,
            "torch": torch.__version__,
            "limits": {"d2h": stats(times[("limit", "d2h")], nbytes),
                       "write": {**stats(times[("limit", "write")], nbytes), "label": notes["write_limit"]}},
            "rows": rows, "targets": targets, "checked_bitwise": checked,
            "skipped": {k: v for k, v in notes.items() if k != "write_limit"}}


def _print(doc: dict[str, Any]) -> None:
    print(f"\n{'':<8}{'':<56}{'median s':>9}{'min':>8}{'max':>8}{'GB/s':>7}{'ratio':>7}  of")
    for r in doc["rows"]:
        print(f"{r['phase']:<8}{r['label']:<56}{r['median_s']:>9.3f}{r['min_s']:>8.3f}{r['max_s']:>8.3f}"
              f"{r['gbps']:>7.2f}{r['ratio']:>7.2f}  {r['limit']}")
    d2h = "D2H into one pinned buffer" if doc["ratios_meaningful"] else "host memcpy (smoke: stands in for D2H)"
    print(f"\nlimit: {d2h} {doc['limits']['d2h']['gbps']:.2f} GB/s")
    print(f"limit: {doc['limits']['write']['label']} {doc['limits']['write']['gbps']:.2f} GB/s")
    print("\nmmapckpt against the targets" + ("" if doc["ratios_meaningful"] else " (smoke run: meaningless)"))
    for t in doc["targets"]:
        print(f"  {t['phase']:<8} {t['method']:<14} {t['ratio']:.2f} (>= {t['target']}): "
              f"{'met' if t['met'] else 'MISSED'}")
    for key, ok in doc["checked_bitwise"].items():
        print(f"checked bitwise: {key}: {'yes' if ok else 'NO'}")
    for key, note in doc["skipped"].items():
        print(f"{key}: {note}")
    if doc.get("note"):
        print(f"note: {doc['note']}")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cuda (default), or cpu: a smoke run of the same code, ratios meaningless")
    parser.add_argument("--size", default=None, help="state dict size (default 2GB; 8MB with --device cpu)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write the checkpoints (default: under the cwd)")
    parser.add_argument("--out", default="cuda_save_bench.json", help="JSON result file")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    dev = device_or_exit(args.device, "cuda_save_bench")

    from mmapckpt.bench.synthetic import parse_size, transformer_state_dict

    warnings.simplefilter("ignore")
    size = parse_size(args.size or ("8MB" if dev.type == "cpu" else "2GB"))
    sd = {k: v.to(dev) for k, v in transformer_state_dict(size, dtype=getattr(torch, args.dtype)).items()}
    where = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "the CPU (smoke run)"
    print(f"{len(sd)} tensors, {sum(t.nbytes for t in sd.values()) / 1e9:.3f} GB on {where}", file=sys.stderr)
    root = tempfile.mkdtemp(prefix=".mmapckpt-cuda-save-bench-", dir=args.dir or os.getcwd())
    try:
        times, checked, notes = _measure(sd, root, args.repeats, dev)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    doc = _document(args, dev, sd, times, checked, notes)
    _print(doc)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=2)
    print(f"\nJSON: {args.out}")
    return 0 if all(checked.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
