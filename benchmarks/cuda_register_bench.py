#!/usr/bin/env python3
"""Registration benchmark: copying a mapped file to a CUDA GPU from its own registered pages.

For one warm (page-cached) file of ``--size`` bytes, mapped as mmapckpt maps shards
(io/mapped.py), measures in one run, each figure the median of ``--repeats``:

- what ``cudaHostRegister(cudaHostRegisterReadOnly)`` of the whole file costs per GB, in
  windows of each ``--windows`` size and as one window (the whole file), and what
  ``cudaHostUnregister`` costs (mmapckpt.io.host_register.HostRegistry, CudaHostDriver);
- host-to-device copy bandwidth from the registered mapping (the steady state of a server
  that keeps a model registered and loads it again), from the same mapping unregistered
  (pageable), and from one pinned buffer: the limit every ratio is taken against;
- end to end, "register + copy + unregister" of the whole file, window by window:
  sequential (register, copy, wait, unregister) and pipelined (window k+1 registered on a
  thread while window k copies; a window unregistered once its copy's event completed).

The first repetition of every copy is checked bitwise against the file. Without a CUDA
device it says why and exits with status 2, having measured nothing. ``--device cpu`` is a
smoke mode for CI: the same code with the RecordingDriver (which registers nothing and
checks the driver's rules) and memcpy into CPU memory; its ratios mean nothing and are
labelled so.

    python benchmarks/cuda_register_bench.py --size 2GB --repeats 3 --out cuda_register_bench.json
    python benchmarks/cuda_register_bench.py --device cpu --size 8MB --windows 1MiB,4MiB --repeats 1
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from cuda_common import device_or_exit, stats, sync

SMOKE_NOTE = ("--device cpu smoke run: a recording driver that registers nothing, memcpy into CPU memory, a tiny "
              "file; the ratios mean nothing, only that every step ran and copied the right bytes")








class Bench:
    """The file, its mapping, the device destination and the driver, shared by every measurement."""

    def __init__(self, path: str, size: int, dev: torch.device) -> None:
        from mmapckpt.io.host_register import PAGE, RecordingDriver, cuda_host_driver
        from mmapckpt.io.mapped import MappedFile, open_regular

        self.dev, self.size = dev, size
        fd = open_regular(path)
        self.mf = MappedFile(fd, path)
        os.close(fd)
        self.lo = self.mf.address()
        self.bounds = (self.lo, self.lo + size)
        self.page = PAGE
        if dev.type == "cuda":
            driver, why = cuda_host_driver(dev.index)
            if driver is None:
                print(f"cuda_register_bench: {why}; nothing was measured.", file=sys.stderr)
                sys.exit(2)
            self.driver = driver
        else:
            self.driver = RecordingDriver()
            self.driver.mapped(*self.bounds)
        self.dst = torch.empty(size, dtype=torch.uint8, device=dev)
        self.ref = self.mf.raw(0, size).to(dev)  # the file's bytes on the device, to check copies against

    def pieces(self, window: int) -> list[tuple[int, int]]:
        """(offset, length) of the file's window-aligned pieces (as the registry tiles it)."""
        from mmapckpt.io.host_register import window_spans

        return [(s - self.lo, e - s) for s, e in window_spans(self.lo, self.size, *self.bounds, window)]

    def registry(self, budget: int, window: int):
        from mmapckpt.io.host_register import HostRegistry

        return HostRegistry(budget, self.driver, window_bytes=window)

    def copy(self, off: int, n: int, non_blocking: bool) -> None:
        self.dst[off:off + n].copy_(self.mf.raw(off, n), non_blocking=non_blocking and self.dev.type == "cuda")

    def check(self, what: str) -> None:
        sync(self.dev)
        if not torch.equal(self.dst, self.ref):
            raise SystemExit(f"cuda_register_bench: {what} copied wrong bytes")
        self.dst.zero_()
        sync(self.dev)


def _register_cost(b: Bench, window: int) -> tuple[float, float, int]:
    """(register s, unregister s, tiles) for the whole file in tiles of ``window``."""
    reg = b.registry(b.size + window, window)
    h = reg.acquire(b.lo, b.size, b.bounds)
    assert h is not None, reg.disabled
    reg.release(h)  # unregisters every tile (keep=False)
    st = reg.stats()
    reg.close()
    return st.register_s, st.unregister_s, st.registrations


def _pinned_limit(b: Bench) -> float:
    piece = min(b.size, 256 << 20)
    src = torch.empty(piece, dtype=torch.uint8, pin_memory=b.dev.type == "cuda")
    src.copy_(b.mf.raw(0, piece))

    def run() -> None:
        for off in range(0, b.size, piece):
            n = min(piece, b.size - off)
            b.dst[off:off + n].copy_(src[:n], non_blocking=b.dev.type == "cuda")
    run()
    sync(b.dev)
    t0 = time.perf_counter()
    run()
    sync(b.dev)
    return time.perf_counter() - t0


def _copy_all(b: Bench, non_blocking: bool) -> float:
    sync(b.dev)
    t0 = time.perf_counter()
    for off, n in b.pieces(256 << 20):
        b.copy(off, n, non_blocking)
    sync(b.dev)
    return time.perf_counter() - t0


def _registered_copy(b: Bench, check: bool) -> float:
    reg = b.registry(b.size + b.page, 256 << 20)
    h = reg.acquire(b.lo, b.size, b.bounds)
    assert h is not None, reg.disabled
    if b.dev.type == "cuda":
        assert b.mf.raw(0, min(b.size, 4096)).is_pinned(), "a view of the registered mapping is not pinned"
    try:
        _copy_all(b, True)  # warm-up
        s = _copy_all(b, True)
        if check:
            b.check("the registered copy")
    finally:
        reg.release(h)
        reg.close()
    return s


def _sequential(b: Bench, window: int) -> float:
    reg = b.registry(window, window)
    sync(b.dev)
    t0 = time.perf_counter()
    for off, n in b.pieces(window):
        h = reg.acquire(b.lo + off, n, b.bounds)
        assert h is not None, reg.disabled
        b.copy(off, n, True)
        sync(b.dev)
        reg.release(h)
    s = time.perf_counter() - t0
    reg.close()
    return s


def _pipelined(b: Bench, window: int) -> float:
    """Window k+1 registered on a thread while window k copies; at most 3 windows registered."""
    reg = b.registry(3 * window, window)
    pieces = b.pieces(window)
    pending: collections.deque = collections.deque()
    with ThreadPoolExecutor(1) as pool:
        sync(b.dev)
        t0 = time.perf_counter()
        fut = pool.submit(reg.acquire, b.lo + pieces[0][0], pieces[0][1], b.bounds)
        for i, (off, n) in enumerate(pieces):
            h = fut.result()
            assert h is not None, reg.disabled
            if i + 1 < len(pieces):
                nxt = pieces[i + 1]
                fut = pool.submit(reg.acquire, b.lo + nxt[0], nxt[1], b.bounds)
            b.copy(off, n, True)
            ev = torch.cuda.Event() if b.dev.type == "cuda" else None
            if ev is not None:
                ev.record()
            pending.append((h, ev))
            while len(pending) > 1:
                h0, ev0 = pending.popleft()
                if ev0 is not None:
                    ev0.synchronize()
                reg.release(h0)
        while pending:
            h0, ev0 = pending.popleft()
            if ev0 is not None:
                ev0.synchronize()
            reg.release(h0)
        sync(b.dev)
        s = time.perf_counter() - t0
    reg.close()
    return s


def _measure(b: Bench, windows: list[int], repeats: int) -> dict[str, Any]:
    gb = b.size / 1e9
    whole = -(-(b.lo + b.size) // b.page) * b.page  # one tile: the whole file (a window past its end)
    reg_rows = []
    for label, w in [(f"{w / 2**20:g} MiB", w) for w in windows] + [("whole file", max(whole, b.page) * 2)]:
        runs = [_register_cost(b, w) for _ in range(repeats)]
        reg_rows.append({"window": label, "window_bytes": w if label != "whole file" else b.size,
                         "tiles": runs[0][2],
                         "register_s_per_gb": statistics.median(r[0] for r in runs) / gb,
                         "unregister_s_per_gb": statistics.median(r[1] for r in runs) / gb})
    limit = stats([_pinned_limit(b) for _ in range(repeats)], b.size)
    _copy_all(b, False)
    b.check("the pageable copy")
    copies = {"pinned buffer (limit)": limit,
              "registered mapping": stats([_registered_copy(b, r == 0) for r in range(repeats)], b.size),
              "pageable mapping": stats([_copy_all(b, False) for _ in range(repeats)], b.size)}
    for row in copies.values():
        row["ratio"] = limit["median_s"] / row["median_s"]
    e2e = []
    for w in windows:
        for mode, fn in (("sequential", _sequential), ("pipelined", _pipelined)):
            times = []
            for r in range(repeats):
                times.append(fn(b, w))
                if r == 0:
                    b.check(f"{mode} register + copy + unregister")
            row = {"window_bytes": w, "mode": mode, **stats(times, b.size)}
            row["ratio"] = limit["median_s"] / row["median_s"]
            e2e.append(row)
    return {"register": reg_rows, "copies": copies, "end_to_end": e2e}


def _write_file(path: str, size: int) -> None:
    """``size`` bytes, each 64 MiB chunk distinct, written then read once so they are page-cached."""
    chunk = torch.randint(0, 256, (min(size, 64 << 20),), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    with open(path, "wb") as f:
        for i, off in enumerate(range(0, size, chunk.numel())):
            chunk[:8] = torch.tensor(list(i.to_bytes(8, "little")), dtype=torch.uint8)
            f.write(chunk[:min(chunk.numel(), size - off)].numpy().tobytes())
    with open(path, "rb") as f:
        while f.read(64 << 20):
            pass


def _print(doc: dict[str, Any]) -> None:
    print(f"\n{doc['bytes'] / 1e9:.3f} GB file on {doc['where']}, median of {doc['repeats']}")
    if doc["smoke"]:
        print(f"NOTE: {doc['note']}")
    print(f"\n{'registration window':<22}{'tiles':>7}{'register s/GB':>15}{'unregister s/GB':>17}")
    for r in doc["register"]:
        print(f"{r['window']:<22}{r['tiles']:>7}{r['register_s_per_gb']:>15.4f}{r['unregister_s_per_gb']:>17.4f}")
    print(f"\n{'host-to-device copy from':<30}{'GB/s':>8}{'ratio to pinned':>17}")
    for name, r in doc["copies"].items():
        print(f"{name:<30}{r['gbps']:>8.2f}{r['ratio']:>17.2f}")
    print(f"\n{'register + copy + unregister':<30}{'window':>12}{'GB/s':>8}{'ratio to pinned':>17}")
    for r in doc["end_to_end"]:
        print(f"{r['mode']:<30}{r['window_bytes'] / 2**20:>8g} MiB{r['gbps']:>8.2f}{r['ratio']:>17.2f}")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cuda (default) measures; cpu is a smoke run with a recording driver")
    parser.add_argument("--size", default=None, help="file size (default 2GB; 8MB with --device cpu)")
    parser.add_argument("--windows", default=None,
                        help="window sizes, comma-separated (default 32MiB,256MiB; 1MiB,4MiB with --device cpu)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write the file (default: under the cwd)")
    parser.add_argument("--out", default="cuda_register_bench.json", help="JSON result file")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    dev = device_or_exit(args.device, "cuda_register_bench")
    from mmapckpt.io.host_register import PAGE
    from mmapckpt.io.sizes import parse_size

    size = parse_size(args.size or ("8MB" if dev.type == "cpu" else "2GB"))
    windows = [-(-parse_size(w) // PAGE) * PAGE
               for w in (args.windows or ("1MiB,4MiB" if dev.type == "cpu" else "32MiB,256MiB")).split(",")]
    where = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "the CPU (smoke run)"
    root = tempfile.mkdtemp(prefix=".mmapckpt-register-bench-", dir=args.dir or os.getcwd())
    t0 = time.perf_counter()
    try:
        path = os.path.join(root, "file.bin")
        _write_file(path, size)
        result = _measure(Bench(path, size, dev), windows, args.repeats)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    doc: dict[str, Any] = {"device": dev.type, "where": where, "smoke": dev.type == "cpu",
                           "ratios_meaningful": dev.type == "cuda", "note": SMOKE_NOTE if dev.type == "cpu" else "",
                           "bytes": size, "repeats": args.repeats, "windows": windows, "checked_bitwise": True,
                           "torch": torch.__version__, "seconds": time.perf_counter() - t0, **result}
    _print(doc)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=2)
    print(f"\nJSON: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
