"""One peer loader, run in its own process for ``mmapckpt bench`` (bench/peers.py starts it).

``python -m mmapckpt.bench.peer_worker KEY DIR SPEC.json THREADS``: imports the peer (with
the environment its settings need already set by the parent: some peers read theirs once
a process, so each variant gets a process of its own and the benchmark's stays clean),
then answers one JSON line on stdout for each JSON line on stdin:

- ``{"op": "setup"}``: writes the peer's own file from ``DIR/model.safetensors`` where it
  needs one (tensorizer's ``model.tensors``), untimed; answers the files its loads read;
- ``{"op": "load", "check": bool}``: one timed load (the parent evicts or warms the files
  first); fill-kind peers copy into targets allocated and zeroed before the clock starts;
  views and new tensors are touched, one byte a page, inside the timed call. With
  ``check``, the loaded bytes are hashed and compared with the source state dict's hashes
  in SPEC.json, name, dtype and shape too;
- ``{"op": "quit"}``.

A peer that cannot be imported answers ``{"error": ...}`` once and exits.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
import traceback
from typing import Any, Callable

import torch

__all__ = ["digest", "main"]

StateDict = dict[str, torch.Tensor]
_MODULES = {"tensorizer": "tensorizer", "runai": "runai_model_streamer", "fastsafetensors": "fastsafetensors"}


def digest(t: torch.Tensor) -> str:
    """A hash of the tensor's bytes, its dtype and shape."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{t.dtype}{tuple(t.shape)}".encode())
    h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()


def _touch(tensors: StateDict) -> int:
    """Read one byte of every page of every tensor (what a consumer of views would fault in)."""
    total = 0
    for t in tensors.values():
        flat = t.detach().reshape(-1).view(torch.uint8)
        total += int(flat[::4096].sum()) if flat.numel() else 0
    return total


def _tensorizer_setup(d: str) -> list[str]:
    from safetensors.torch import load_file
    from tensorizer import TensorSerializer

    path = os.path.join(d, "model.tensors")
    if not os.path.exists(path):
        tmp = path + ".tmp"
        s = TensorSerializer(tmp)
        s.write_state_dict(load_file(os.path.join(d, "model.safetensors")))
        s.close()
        os.replace(tmp, path)
    return [path]


def _tensorizer_load(d: str, targets: StateDict | None, info: dict[str, Any]) -> StateDict:
    from tensorizer import TensorDeserializer

    # The documented fast path: eager loading, the reader count its own (8 for a local file), no hash checks.
    des = TensorDeserializer(os.path.join(d, "model.tensors"), device="cpu")
    info["num_readers"] = getattr(des, "_num_readers", None)
    out = {k: des[k] for k in des.keys()}
    des.close()
    return out


def _runai_load(d: str, targets: StateDict | None, info: dict[str, Any]) -> StateDict:
    from runai_model_streamer import SafetensorsStreamer

    if targets is None:
        raise ValueError("the Run:ai row fills targets")
    with SafetensorsStreamer() as s:
        s.stream_file(os.path.join(d, "model.safetensors"), device="cpu", owned=False)
        for name, t in s.get_tensors():  # views into its ring buffer: consumed before the next
            targets[name].copy_(t)
    return targets


def _fst_load(d: str, targets: StateDict | None, info: dict[str, Any]) -> StateDict:
    from fastsafetensors import fastsafe_open

    with fastsafe_open(os.path.join(d, "model.safetensors"), framework="pt", device="cpu", nogds=True) as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # they keep the buffer alive past the block


_LOADERS: dict[str, tuple[str, Callable[..., StateDict]]] = {
    "tensorizer": ("new", _tensorizer_load), "runai": ("fill", _runai_load), "fastsafetensors": ("views", _fst_load)}


def _family(key: str) -> str:
    return key.split("-", 1)[0]


class _Worker:
    def __init__(self, key: str, d: str, spec: dict[str, list[Any]]) -> None:
        self.key, self.dir, self.spec = key, d, spec
        self.kind, self.fn = _LOADERS[_family(key)]

    def setup(self) -> dict[str, Any]:
        if _family(self.key) == "tensorizer":
            return {"reads": _tensorizer_setup(self.dir)}
        return {"reads": [os.path.join(self.dir, "model.safetensors")]}

    def load(self, check: bool) -> dict[str, Any]:
        targets = None
        if self.kind == "fill":
            targets = {k: torch.zeros(shape, dtype=getattr(torch, dt)) for k, (shape, dt, _) in self.spec.items()}
        info: dict[str, Any] = {}
        t0 = time.perf_counter()
        out = self.fn(self.dir, targets, info)
        if self.kind != "fill":
            _touch(out)
        seconds = time.perf_counter() - t0
        answer: dict[str, Any] = {"s": seconds, **info}
        if check:
            bad = sorted(set(self.spec) ^ set(out)) + [k for k in self.spec if k in out and
                                                        digest(out[k]) != self.spec[k][2]]
            answer["bitwise"], answer["mismatch"] = not bad, bad[:3]
        del out, targets
        return answer


def main(argv: list[str]) -> int:
    key, d, spec_path, threads = argv
    proto = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # whatever the peer prints goes to the log, not into the answers
    sys.stdout = sys.stderr

    def say(obj: dict[str, Any]) -> None:
        proto.write(json.dumps(obj) + "\n")
        proto.flush()

    if int(threads) > 0:
        torch.set_num_threads(int(threads))
    try:
        module = __import__(_MODULES[_family(key)])
    except BaseException as e:  # noqa: BLE001 - reported as the row's reason
        say({"error": f"not installed: {type(e).__name__}: {e}"})
        return 0
    from importlib.metadata import PackageNotFoundError, version

    try:
        ver = version({"runai": "runai-model-streamer"}.get(_family(key), _family(key)))
    except PackageNotFoundError:
        ver = getattr(module, "__version__", "unknown")
    with open(spec_path) as f:
        worker = _Worker(key, d, json.load(f))
    say({"ready": True, "version": ver, "kind": worker.kind})
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            if cmd["op"] == "quit":
                break
            say(worker.setup() if cmd["op"] == "setup" else worker.load(bool(cmd.get("check"))))
        except BaseException as e:  # noqa: BLE001 - reported as the row's reason
            traceback.print_exc()
            say({"error": f"failed: {type(e).__name__}: {e}"[:300]})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
