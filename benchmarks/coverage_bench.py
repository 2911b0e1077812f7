"""The checks every index gets (format/tiling.py), per chunk, beside the decode they are part of.

``python benchmarks/coverage_bench.py [--chunks 1000,6000,12000] [--entries 100000] [--repeats 7]``
writes ``.metadata`` files (the decode needs no shard) and times, interleaved round-robin so that a
noisy machine slows every operation alike, medians of R:

- for each N of ``--chunks``, one tensor stored as N one-row chunks (a world of N ranks sharding
  dimension 0) and as a grid of about N blocks (two-dimensional sharding):
  ``decode`` (``read_index_file``, checks included), ``unchecked`` (the same decode with
  ``check_entries`` made a no-op: the difference is what the checks cost) and ``tiling``
  (``tiling_problem`` on the chunks alone);
- for ``--entries`` whole tensors of one chunk each (the common table, checked in bulk):
  ``decode`` and ``unchecked`` (the bulk range check ``format/metadata/v2_columns.py`` ``_disjoint`` made a no-op).

It prints microseconds per chunk (or entry) and the checks' share of the decode.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import tempfile
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch

__all__ = ["write_layout", "measure_layout", "main"]


def write_layout(path: str, chunks: list[tuple[tuple[int, ...], tuple[int, ...]]], shape: tuple[int, ...],
                 tensors: int = 1) -> None:
    """A ``.metadata`` naming ``tensors`` float32 tensors of ``shape``, each stored as ``chunks``."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex,
                                                       TensorProperties, TensorStorageMetadata)

    from mmapckpt.format.metadata import encode_metadata

    sdm: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    at = 1024
    for t in range(tensors):
        fqn = f"layer{t}.weight"
        sdm[fqn] = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size(shape),
                                         [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in chunks])
        for o, s in chunks:
            n = math.prod(s) * 4
            storage[MetadataIndex(fqn, torch.Size(o))] = _StorageInfo("__0_0.distcp", at, n)
            at += -(-n // 64) * 64
    with open(path, "wb") as f:
        f.write(encode_metadata(Metadata(sdm, storage_data=storage)))


@contextmanager
def _patched(module: Any, name: str, value: Any) -> Iterator[None]:
    old = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, old)


def _timed(ops: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """The median seconds of each operation, ``repeats`` rounds of every operation in turn."""
    times: dict[str, list[float]] = {k: [] for k in ops}
    for fn in ops.values():
        fn()
    for _ in range(repeats):
        for name, fn in ops.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def measure_layout(path: str, chunks: list[tuple[tuple[int, ...], tuple[int, ...]]], shape: tuple[int, ...],
                   repeats: int) -> dict[str, float]:
    """Seconds of the decode, the decode without the checks, and the tiling check alone."""
    from mmapckpt.format.metadata import v2
    from mmapckpt.storage.commits import read_index_file
    from mmapckpt.format.tiling import tiling_problem

    def unchecked() -> object:
        with _patched(v2, "check_entries", lambda entries, path: None):
            return read_index_file(path)

    return _timed({"decode": lambda: read_index_file(path), "unchecked": unchecked,
                   "tiling": lambda: tiling_problem(shape, chunks)}, repeats)


def _bulk(path: str, repeats: int) -> dict[str, float]:
    from mmapckpt.format.metadata import v2_columns
    from mmapckpt.storage.commits import read_index_file

    def unchecked() -> object:
        with _patched(v2_columns, "_disjoint", lambda *a: True):
            return read_index_file(path)

    return _timed({"decode": lambda: read_index_file(path), "unchecked": unchecked}, repeats)


def _row(what: str, n: int, t: dict[str, float]) -> str:
    us = {k: v / n * 1e6 for k, v in t.items()}
    checks = us["decode"] - us["unchecked"]
    extra = f" {us['tiling']:9.3f}" if "tiling" in us else f" {'':9}"
    return (f"{what:<26} {n:>7} {us['decode']:9.3f} {us['unchecked']:9.3f} {checks:9.3f}{extra} "
            f"{checks / us['decode']:7.1%}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python benchmarks/coverage_bench.py", description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", default="1000,6000,12000")
    ap.add_argument("--entries", type=int, default=100_000)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args(argv)
    print(f"medians of {args.repeats} interleaved rounds; microseconds per chunk (per entry for the table)")
    print(f"{'layout':<26} {'chunks':>7} {'decode':>9} {'unchecked':>9} {'checks':>9} {'tiling':>9} {'share':>7}")
    with tempfile.TemporaryDirectory() as root:
        path = os.path.join(root, ".metadata")
        for n in (int(x) for x in args.chunks.split(",")):
            rows = [((i, 0), (1, 8)) for i in range(n)]
            write_layout(path, rows, (n, 8))
            print(_row("one tensor, row chunks", n, measure_layout(path, rows, (n, 8), args.repeats)))
            a = max(1, round(math.sqrt(n)))
            b = max(1, n // a)
            grid = [((i * 2, j * 2), (2, 2)) for i in range(a) for j in range(b)]
            write_layout(path, grid, (2 * a, 2 * b))
            print(_row("one tensor, grid of blocks", len(grid), measure_layout(path, grid, (2 * a, 2 * b),
                                                                                args.repeats)))
        write_layout(path, [((0,), (4,))], (4,), tensors=args.entries)
        print(_row("whole tensors (bulk)", args.entries, _bulk(path, args.repeats)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
