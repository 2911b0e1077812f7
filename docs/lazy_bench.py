"""Measurements behind docs/lazy.md: lazy load vs safetensors, and madvise hints.

Usage: python docs/lazy_bench.py DIR [--gib 1.0] [--runs 5]

Every timed run is a fresh subprocess (clean RssAnon, no Python-level caches).
"Warm" runs read files already in the page cache; "cold" runs first evict the
files with posix_fadvise(DONTNEED) (after fsync), which works without root.
Prints medians as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import textwrap

from mmapckpt.bench.system import evict

_CHILD = textwrap.dedent("""
    import json, mmap, os, sys, time, torch
    import mmapckpt, safetensors.torch
    from safetensors import safe_open
    def anon():
        for line in open("/proc/self/status"):
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    def touch(sd):
        return sum(int(t.view(torch.uint8)[::4096].sum()) for t in sd.values())
    mode, ck, st = sys.argv[1], sys.argv[2], sys.argv[3]
    torch.zeros(1).sum()
    a0 = anon(); t0 = time.perf_counter()
    if mode == "mm_load":
        sd = mmapckpt.load(ck)
    elif mode == "mm_load_touch":
        sd = mmapckpt.load(ck); touch(sd)
    elif mode == "mm_load_prefetch":
        sd = mmapckpt.load(ck, prefetch=True)
    elif mode == "mm_load_prefetch_touch":
        sd = mmapckpt.load(ck, prefetch=True); touch(sd)
    elif mode == "mm_load_seq_touch":
        with mmapckpt.open(ck) as f:
            for n in f.keys():
                for c in f.metadata(n).chunks:
                    f._files.advise(c, mmap.MADV_SEQUENTIAL)
            sd = {n: f.get_tensor(n) for n in f.keys()}
        touch(sd)
    elif mode == "mm_open_get_all":
        with mmapckpt.open(ck) as f:
            sd = {n: f.get_tensor(n) for n in f.keys()}
    elif mode == "mm_slice":        # 1/64 of the rows of every tensor
        with mmapckpt.open(ck) as f:
            sd = {n: f.get_slice(n)[::64] for n in f.keys()}
    elif mode in ("mm_slice_prefetch", "mm_slice_random"):  # a hint on every tensor first
        advice = mmap.MADV_WILLNEED if mode == "mm_slice_prefetch" else mmap.MADV_RANDOM
        with mmapckpt.open(ck) as f:
            for n in f.keys():
                for c in f.metadata(n).chunks:
                    f._files.advise(c, advice)
            sd = {n: f.get_slice(n)[::64] for n in f.keys()}
    elif mode == "st_load_file":
        sd = safetensors.torch.load_file(st)
    elif mode == "st_load_file_touch":
        sd = safetensors.torch.load_file(st); touch(sd)
    elif mode == "st_load_file_pread":
        sd = safetensors.torch.load_file(st, backend="pread")
    elif mode == "st_safe_open_get_all":
        with safe_open(st, "pt") as f:
            sd = {n: f.get_tensor(n) for n in f.keys()}
    else:
        raise SystemExit(mode)
    dt = time.perf_counter() - t0
    print(json.dumps({"s": dt, "anon": anon() - a0}))
""")


def _files(ck: str, st: str) -> list[str]:
    return [os.path.join(ck, n) for n in os.listdir(ck)] + [st]


def _make(root: str, gib: float) -> tuple[str, str]:
    import torch
    import torch.distributed.checkpoint as dcp
    import safetensors.torch
    import mmapckpt

    ck, st = os.path.join(root, "ck"), os.path.join(root, "model.safetensors")
    if os.path.exists(os.path.join(ck, ".metadata")) and os.path.exists(st):
        return ck, st
    g = torch.Generator().manual_seed(0)
    n = int(gib * 256)  # 4 MiB tensors: 1024 x 1024 float32
    sd = {f"layers.{i}.weight": torch.randn(1024, 1024, generator=g) for i in range(n)}
    dcp.save(sd, storage_writer=mmapckpt.MmapWriter(ck), no_dist=True)
    safetensors.torch.save_file(sd, st)
    return ck, st


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--modes", default="")
    args = ap.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    ck, st = _make(args.dir, args.gib)
    plan = [("warm", m) for m in ("mm_load", "mm_load_touch", "st_load_file", "st_load_file_touch",
                                  "st_load_file_pread")]
    plan += [("cold", m) for m in ("mm_load", "mm_load_prefetch", "mm_load_touch", "mm_load_prefetch_touch",
                                   "mm_load_seq_touch", "st_load_file", "st_load_file_touch", "st_load_file_pread",
                                   "mm_slice", "mm_slice_prefetch", "mm_slice_random")]
    if args.modes:
        plan = [p for p in plan if f"{p[0]}:{p[1]}" in args.modes.split(",")]
    out = {}
    for _ in range(args.runs):  # interleave the modes so that machine load affects all alike
        for cache, mode in plan:
            if cache == "cold":
                evict(_files(ck, st))
            else:  # warm: read everything once first
                for p in _files(ck, st):
                    with open(p, "rb") as f:
                        while f.read(64 << 20):
                            pass
            r = subprocess.run([sys.executable, "-c", _CHILD, mode, ck, st], capture_output=True, text=True)
            if r.returncode:
                print(f"{cache}:{mode} failed: {r.stderr[-500:]}", file=sys.stderr)
                continue
            out.setdefault(f"{cache}:{mode}", []).append(json.loads(r.stdout.strip().splitlines()[-1]))
            print(cache, mode, out[f"{cache}:{mode}"][-1], file=sys.stderr, flush=True)
    med = {k: {"median_s": statistics.median(x["s"] for x in v),
               "median_anon_mib": statistics.median(x["anon"] for x in v) / 2**20, "runs": len(v)}
           for k, v in out.items()}
    print(json.dumps(med, indent=1))


if __name__ == "__main__":
    main()
