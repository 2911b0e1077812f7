"""Metadata decode against safetensors' header parse, side by side in one process.

``python benchmarks/metadecode_bench.py [--entries N] [--repeats R] [--mixed]`` saves N small
tensors (four floats each; ``--mixed``: shapes (2, 2), (4,), (2, 2), (4,), () in turn, as a
model's weights, biases and optimizer steps) with ``mmapckpt.save`` and
``safetensors.torch.save_file``, then times, interleaved round-robin so that a noisy
machine slows every operation alike:

- ``safetensors``: ``safe_open(path, "pt")`` + ``keys()`` (the reference);
- ``index``: ``read_index_file`` (what ``open``, ``load`` and ``load_into`` decode);
- ``open_keys``: ``mmapckpt.open(path)`` + ``keys()``;
- ``index_all``: ``read_index_file`` and a look at every entry's first chunk;
- ``metadata``: ``read_metadata_file`` (DCP ``Metadata`` with every record built, what DCP's
  default planners plan with);
- ``metadata_lazy``: ``read_metadata_file(lazy=True)`` (what ``MmapReader.read_metadata``
  returns: the records built on first request, which ``FastLoadPlanner`` does not make);
- ``json``: ``json.loads`` of the body alone (the floor of the standard-library decode).

It prints microseconds per entry (median of R) and each one's ratio to safetensors.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from typing import Callable

import torch

__all__ = ["make_checkpoints", "operations", "measure", "main"]


#: the shapes of ``--mixed``, in turn
MIXED_SHAPES = ((2, 2), (4,), (2, 2), (4,), ())


def make_checkpoints(root: str, entries: int, *, mixed: bool = False) -> tuple[str, str]:
    """An mmapckpt checkpoint and a safetensors file of ``entries`` small tensors; their paths."""
    from safetensors.torch import save_file

    from mmapckpt.saving import save

    shapes = MIXED_SHAPES if mixed else ((4,),)
    sd = {f"layer{i // 8}.param{i % 8}": torch.full(shapes[i % len(shapes)], float(i)) for i in range(entries)}
    ck, st = os.path.join(root, "ckpt"), os.path.join(root, "model.safetensors")
    save(sd, ck)
    save_file(sd, st)
    return ck, st


def operations(ck: str, st: str) -> dict[str, Callable[[], object]]:
    """The operations compared, by name (``safetensors`` is the reference)."""
    from safetensors import safe_open

    from mmapckpt.format.metadata.framing import META_PREAMBLE, METADATA_NAME
    from mmapckpt.dcp.metadata import read_metadata_file
    from mmapckpt.storage.commits import read_index_file
    from mmapckpt.lazy import open as open_ckpt

    meta = os.path.join(ck, METADATA_NAME)

    def st_keys() -> object:
        with safe_open(st, "pt") as f:
            return f.keys()

    def open_keys() -> object:
        with open_ckpt(ck) as f:
            return f.keys()

    def index_all() -> object:
        _, entries, _ = read_index_file(meta)
        return [e.chunks[0].file for e in entries.values()]

    def body_json() -> object:
        with open(meta, "rb") as f:
            return json.loads(f.read()[META_PREAMBLE.size:])

    return {"safetensors": st_keys, "index": lambda: read_index_file(meta), "open_keys": open_keys,
            "index_all": index_all, "metadata": lambda: read_metadata_file(meta),
            "metadata_lazy": lambda: read_metadata_file(meta, lazy=True), "json": body_json}


def measure(ops: dict[str, Callable[[], object]], repeats: int) -> dict[str, list[float]]:
    """Seconds of each operation, ``repeats`` rounds, each round running every operation once in turn."""
    times: dict[str, list[float]] = {k: [] for k in ops}
    for fn in ops.values():  # one untimed run each: imports, page cache
        fn()
    for _ in range(repeats):
        for name, fn in ops.items():
            t0 = time.perf_counter()
            out = fn()
            times[name].append(time.perf_counter() - t0)
            del out
    return times


def render(times: dict[str, list[float]], entries: int, mixed: bool = False) -> str:
    ref = statistics.median(times["safetensors"])
    lines = [f"{entries} entries{' (mixed ranks)' if mixed else ''}, medians of {len(times['safetensors'])} "
             "interleaved rounds",
             f"{'operation':<12} {'us/entry':>9} {'x safetensors':>14}"]
    for name, xs in times.items():
        m = statistics.median(xs)
        lines.append(f"{name:<12} {m / entries * 1e6:9.2f} {m / ref:14.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python benchmarks/metadecode_bench.py", description=__doc__.splitlines()[0])
    ap.add_argument("--entries", type=int, default=100_000)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--mixed", action="store_true", help="tensors of ranks 0, 1 and 2 in turn")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as root:
        ck, st = make_checkpoints(root, args.entries, mixed=args.mixed)
        print(render(measure(operations(ck, st), args.repeats), args.entries, args.mixed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
