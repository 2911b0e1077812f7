"""The local cache of remote checkpoints (storage/cache/), beside the loads it replaces.

``python benchmarks/cache_bench.py s3://BUCKET/PREFIX [--size 512MB] [--rounds 3] [--cache DIR]`` (the ``s3``
extra; credentials and endpoint from the ``AWS_*`` environment).

One state dict (transformer-shaped), saved once to the URL and once to a local directory beside the cache.
Rows, alternated round by round, each ``load_into`` preallocated targets and checked bitwise once:

- ``local warm``: the local checkpoint, its pages cached (the target a warm cached load is held to, >= 0.9);
- ``cache warm``: the URL through a filled cache (a LIST, one HEAD per file, then the local copies mapped);
- ``url, no cache``: the URL read straight into the targets (ranged GETs);
- ``url, cache cold``: the URL through an emptied cache (the fetch into the cache, its CRC-32 check, the load
  from the copies): held to >= 0.9 of the row above.

Prints each row's median seconds and GB/s, the ratios, and the load average before and after.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
import uuid

import torch

import mmapckpt
from mmapckpt.bench.synthetic import transformer_state_dict


def _parse_size(s: str) -> int:
    units = {"KB": 1e3, "MB": 1e6, "GB": 1e9}
    for u, m in units.items():
        if s.upper().endswith(u):
            return int(float(s[:-2]) * m)
    return int(s)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python benchmarks/cache_bench.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("url")
    ap.add_argument("--size", default="512MB")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cache", default=None, help="cache directory (default: a temporary one)")
    args = ap.parse_args(argv)
    sd = transformer_state_dict(_parse_size(args.size))
    nbytes = sum(t.nbytes for t in sd.values())
    work = tempfile.mkdtemp(prefix="cache-bench-", dir=args.cache and os.path.dirname(os.path.abspath(args.cache)))
    cache = args.cache or os.path.join(work, "cache")
    local = os.path.join(work, "local")
    url = f"{args.url.rstrip('/')}/mmapckpt-cache-bench-{uuid.uuid4().hex[:8]}"
    print(f"{nbytes / 1e9:.2f} GB, {len(sd)} tensors; load average {os.getloadavg()}")
    mmapckpt.save(sd, local)
    mmapckpt.save(sd, url)
    targets = {k: torch.empty_like(v) for k, v in sd.items()}

    def check(what: str) -> None:
        for k, v in sd.items():
            if not torch.equal(targets[k].view(torch.uint8), v.view(torch.uint8)):
                raise SystemExit(f"{what}: {k} differs")

    def local_warm() -> None:
        mmapckpt.load_into(targets, local)

    def cache_warm() -> None:
        mmapckpt.load_into(targets, url, storage_options={"cache_dir": cache})

    def url_plain() -> None:
        mmapckpt.load_into(targets, url)

    def cache_cold() -> None:
        shutil.rmtree(cache, ignore_errors=True)
        mmapckpt.load_into(targets, url, storage_options={"cache_dir": cache})

    rows = {"local warm": local_warm, "cache warm": cache_warm, "url, no cache": url_plain,
            "url, cache cold": cache_cold}
    local_warm(), cache_cold()  # pages of both in memory; the cache filled
    times: dict[str, list[float]] = {k: [] for k in rows}
    try:
        for r in range(args.rounds):
            order = list(rows) if r % 2 == 0 else list(reversed(rows))
            for name in order:
                if name == "cache warm" and not os.path.isdir(cache):
                    cache_cold()
                for t in targets.values():
                    t.zero_()
                t0 = time.perf_counter()
                rows[name]()
                times[name].append(time.perf_counter() - t0)
                if r == 0:
                    check(name)
    finally:
        try:
            mmapckpt.storage.storage_for(url).remove(
                mmapckpt.storage.storage_for(url).list(), sync=False)
        except Exception as e:  # noqa: BLE001 - the run's objects: say so, do not hide the results
            print(f"could not remove {url}: {e}")
        shutil.rmtree(work, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    for k, v in times.items():
        print(f"{k:18s} median {med[k]:.3f} s  {nbytes / med[k] / 1e9:.2f} GB/s  runs {[round(x, 3) for x in v]}")
    print(f"cache warm / local warm: {med['local warm'] / med['cache warm']:.2f}")
    print(f"cache cold / no cache:   {med['url, no cache'] / med['url, cache cold']:.2f}")
    print(f"load average {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
