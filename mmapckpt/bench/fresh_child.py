"""One load in a new process, for ``mmapckpt bench --fresh`` (bench/fresh.py starts it).

``python -P .../fresh_child.py WHAT WORK``: run as a script (``-P``: its directory is not put
on ``sys.path``), so no module of mmapckpt is imported before the clock starts unless the
load itself needs it. It imports torch, allocates what the load fills (zeroed targets for
``fill`` loads, a model on the meta device for ``load_model``; nothing for the others), then
starts the clock, imports the library and loads (new tensors and views are touched, one byte
a page), stops the clock, and only then checks the result: a hash of every loaded tensor's
bytes, dtype and shape, compared with the saved state dict's (``WORK/spec.json``, written by
the parent). It answers one JSON line on stdout: ``{"s": seconds, "cpu_s": the process's CPU seconds over the same
span (``time.process_time``: every thread's user and system time), "sys_s": the system part of them (``getrusage``),
"ok": bool, "bad": [...]}``,
or ``{"error": ...}``; ``{"setup": [...]}`` for ``setup-tensorizer`` (untimed).

``WHAT`` is a method of bench/fresh.py (``load_into``, ``dcp_load``, ``load``, ``load_model``,
``safetensors_load_file``, ``safetensors_safe_open``, ``torch_load``, a peer of bench/peers.py),
``read`` (the limit: every byte of the checkpoint's files read into fresh memory), or one of the
many-entry rows (``open_keys``, ``safetensors_keys``).
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import resource
import sys
import time
import traceback
import warnings
from typing import Any, Callable

import torch

__all__ = ["main"]

StateDict = dict[str, torch.Tensor]
#: The reads of the ``read`` limit (the size of the in-process bench's sequential limit).
_CHUNK = 64 << 20


def _clock() -> tuple[float, float, float]:
    """Now: wall seconds, this process's CPU seconds (every thread) and its system CPU seconds (the kernel's share)."""
    return time.perf_counter(), time.process_time(), resource.getrusage(resource.RUSAGE_SELF).ru_stime


def _since(start: tuple[float, float, float]) -> dict[str, float]:
    """The span from ``start`` (:func:`_clock`): ``s``, ``cpu_s`` and ``sys_s`` (the system part of ``cpu_s``: a
    load slowed by the kernel, e.g. its copies from the page cache, shows there)."""
    now = _clock()
    return {"s": now[0] - start[0], "cpu_s": now[1] - start[1], "sys_s": now[2] - start[2]}


def _touch(tensors: StateDict) -> int:
    """Read one byte of every page of every tensor (what a consumer of views faults in)."""
    total = 0
    for t in tensors.values():
        flat = t.detach().reshape(-1).view(torch.uint8)
        total += int(flat[::4096].sum()) if flat.numel() else 0
    return total


def _face() -> Any:
    """``import mmapckpt``, as a user's script does. This file runs as a program of its own, standing for
    such a script: it measures the public face's import on purpose (by name, so the package's import
    contracts, which keep its modules off the face, do not count this program as one of them)."""
    return importlib.import_module("mmapckpt")


def _files(d: str) -> list[str]:
    return sorted(os.path.join(r, n) for r, _, names in os.walk(d) for n in names)


# ------------------------------------------------------------------ the loads: (work, targets, model) -> tensors
def _load_into(w: str, targets: StateDict, model: Any) -> StateDict:
    mmapckpt = _face()
    mmapckpt.load_into(targets, os.path.join(w, "ckpt"))
    return targets


def _dcp_load(w: str, targets: StateDict, model: Any) -> StateDict:
    import torch.distributed.checkpoint as dcp

    MmapReader = _face().MmapReader  # noqa: N806 - the class, as `from mmapckpt import MmapReader` gives it

    with warnings.catch_warnings():  # DCP warns that no_dist assumes one process
        warnings.simplefilter("ignore")
        dcp.load(targets, storage_reader=MmapReader(os.path.join(w, "ckpt")), no_dist=True)
    return targets


def _load(w: str, targets: StateDict, model: Any) -> StateDict:
    mmapckpt = _face()
    return mmapckpt.load(os.path.join(w, "ckpt"))


def _load_model(w: str, targets: StateDict, model: Any) -> StateDict:
    mmapckpt = _face()
    mmapckpt.load_model(model, os.path.join(w, "ckpt"))
    return dict(model.state_dict())


def _st_load_file(w: str, targets: StateDict, model: Any) -> StateDict:
    from safetensors.torch import load_file

    return load_file(os.path.join(w, "model.safetensors"))


def _st_safe_open(w: str, targets: StateDict, model: Any) -> StateDict:
    from safetensors import safe_open

    with safe_open(os.path.join(w, "model.safetensors"), framework="pt") as f:
        for k in f.keys():
            targets[k].copy_(f.get_tensor(k))
    return targets


def _torch_load(w: str, targets: StateDict, model: Any) -> StateDict:
    return torch.load(os.path.join(w, "model.pt"), mmap=True, weights_only=True)


#: key -> (what it needs before the clock: "targets", "model" or "", the load)
_LOADS: dict[str, tuple[str, Callable[[str, StateDict, Any], StateDict]]] = {
    "load_into": ("targets", _load_into), "dcp_load": ("targets", _dcp_load), "load": ("", _load),
    "load_model": ("model", _load_model), "safetensors_load_file": ("", _st_load_file),
    "safetensors_safe_open": ("targets", _st_safe_open), "torch_load": ("", _torch_load)}


def _meta_model(spec: dict[str, list[Any]]) -> torch.nn.Module:
    """An nn.Module on the meta device whose state dict has the spec's names, shapes and dtypes."""
    root = torch.nn.Module()
    with torch.device("meta"):
        for name, (shape, dtype, _) in spec.items():
            mod = root
            *path, leaf = name.split(".")
            for part in path:
                if not hasattr(mod, part):
                    mod.add_module(part, torch.nn.Module())
                mod = getattr(mod, part)
            mod.register_parameter(leaf, torch.nn.Parameter(torch.empty(shape, dtype=getattr(torch, dtype)),
                                                            requires_grad=False))
    return root


def _check(spec: dict[str, list[Any]], out: StateDict) -> list[str]:
    """The names that are missing, extra or hold other bytes (checked after the clock stopped)."""
    from mmapckpt.bench.peer_worker import digest as _digest  # the hash the parent wrote the spec with

    return sorted(set(spec) ^ set(out)) + [k for k in spec if k in out and _digest(out[k]) != spec[k][2]]


def _timed_load(what: str, w: str, spec: dict[str, Any]) -> dict[str, Any]:
    tensors = spec["tensors"]
    info: dict[str, Any] = {}
    if what in _LOADS:
        needs, fn = _LOADS[what]
        kind = "fill" if needs == "targets" else "views"
    else:  # a peer: its loader imports its library inside the call
        from mmapckpt.bench.peer_worker import _LOADERS  # noqa: PLC2701 - the peers' own loaders, reused

        kind, peer_fn = _LOADERS[what.split("-", 1)[0]]
        needs = "targets" if kind == "fill" else ""

        def fn(w_: str, targets: StateDict, model: Any) -> StateDict:
            return peer_fn(w_, targets, info)
    targets = {k: torch.zeros(s, dtype=getattr(torch, dt)) for k, (s, dt, _) in tensors.items()} \
        if needs == "targets" else {}
    model = _meta_model(tensors) if needs == "model" else None
    start = _clock()
    out = fn(w, targets, model)
    if kind != "fill":
        _touch(out)
    took = _since(start)
    bad = _check(tensors, out)
    return {**took, "ok": not bad, "bad": bad[:3], **info}


def _read(w: str, spec: dict[str, Any]) -> dict[str, Any]:
    """The limit: every byte of the checkpoint's files, in file order, into memory allocated but never touched."""
    paths = _files(os.path.join(w, "ckpt"))
    buf = torch.empty(sum(os.path.getsize(p) for p in paths), dtype=torch.uint8)
    view = memoryview(buf.numpy()).cast("B")
    start = _clock()
    off = 0
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while n := f.readinto(view[off:off + _CHUNK]):
                off += n
    took = _since(start)
    h = hashlib.blake2b(view[:off], digest_size=16).hexdigest()
    return {**took, "ok": off == len(view) and h == spec["files_digest"], "bad": []}


def _keys(what: str, w: str, spec: dict[str, Any]) -> dict[str, Any]:
    """``import mmapckpt`` + ``open(path).keys()``, or safetensors' ``safe_open(...).keys()`` (its import included)."""
    start = _clock()
    if what == "open_keys":
        mmapckpt = _face()
        with mmapckpt.open(os.path.join(w, "ckpt")) as f:
            keys = list(f.keys())
    else:
        from safetensors import safe_open

        with safe_open(os.path.join(w, "model.safetensors"), framework="pt") as f:
            keys = list(f.keys())
    took = _since(start)
    return {**took, "ok": sorted(keys) == sorted(spec["tensors"]), "bad": []}


def _tensorizer_setup(w: str) -> dict[str, Any]:
    from mmapckpt.bench.peer_worker import _tensorizer_setup as setup  # noqa: PLC2701 - the peers' own setup

    return {"setup": setup(w)}


def main(argv: list[str]) -> int:
    what, w = argv
    answer = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # whatever a library prints goes to stderr, not into the answer
    sys.stdout = sys.stderr
    threads = int(os.environ.get("MMAPCKPT_BENCH_THREADS", "0"))
    if threads > 0:
        torch.set_num_threads(threads)
    try:
        with open(os.path.join(w, "spec.json")) as f:
            spec = json.load(f)
        if what == "setup-tensorizer":
            out = _tensorizer_setup(w)
        elif what == "read":
            out = _read(w, spec)
        elif what in ("open_keys", "safetensors_keys"):
            out = _keys(what, w, spec)
        else:
            out = _timed_load(what, w, spec)
    except ImportError as e:
        out = {"error": f"not installed: {type(e).__name__}: {e}"[:300], "missing": True}
    except BaseException as e:  # noqa: BLE001 - the parent reports it as the row's reason
        traceback.print_exc()
        out = {"error": f"failed: {type(e).__name__}: {e}"[:300]}
    answer.write(json.dumps(out) + "\n")
    answer.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
