"""The peer loaders in ``mmapckpt bench``: tensorizer, the Run:ai Model Streamer and fastsafetensors.

Each peer runs with the settings its documentation gives for speed, named in its row,
in a process of its own (bench/peer_worker.py): Run:ai reads its file-system strategy once a
process, fastsafetensors its O_DIRECT switch from the environment, so the buffered and the
O_DIRECT variants cannot share one, and the benchmark's process never imports a peer.
The peers are the ``peers`` extra; one that does not install or fails says why in one line
and the run goes on.

Rows say what a load returns: ``fill`` (copied into preallocated targets, as ``load_into``),
``new`` (new tensors) or ``views`` (tensors over the loader's own buffer); new tensors and
views are touched, one byte a page, inside the timed call. Every peer's first load is
compared bit for bit with the source state dict.
"""

from __future__ import annotations

import json
import os
import re
import select
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["Peer", "PEERS", "PEER_KEYS", "peer_by_key", "PeerRun", "family"]

StateDict = dict[str, torch.Tensor]
#: The longest a peer may take to answer (start, setup or one load) before it is killed and reported.
_ANSWER_TIMEOUT_S = 900


@dataclass(frozen=True)
class Peer:
    """One peer loader with one set of settings."""

    key: str
    label: str
    settings: str
    direct: bool
    env: dict[str, str] = field(default_factory=dict)


_RUNAI_ENV = {"RUNAI_STREAMER_CONCURRENCY": "16", "RUNAI_STREAMER_LOG_TO_STDERR": "1",
              "RUNAI_STREAMER_LOG_LEVEL": "INFO"}
PEERS: tuple[Peer, ...] = (
    Peer("tensorizer", "tensorizer TensorDeserializer(device='cpu')",
         "eager load (lazy_load=False), num_readers: its own choice (8 for a local file), verify_hash=False, "
         "buffered reads", direct=False),
    Peer("runai", "Run:ai SafetensorsStreamer.stream_file(owned=False) + copy_",
         "RUNAI_STREAMER_CONCURRENCY=16, 2 MiB blocks (its defaults), its default strategy list "
         "(io_uring_direct first)", direct=True, env=dict(_RUNAI_ENV)),
    Peer("runai-buffered", "Run:ai SafetensorsStreamer.stream_file(owned=False) + copy_",
         "RUNAI_STREAMER_CONCURRENCY=16, RUNAI_STREAMER_FS_STRATEGY=sync_buffered (page-cache reads)",
         direct=False, env={**_RUNAI_ENV, "RUNAI_STREAMER_FS_STRATEGY": "sync_buffered"}),
    Peer("fastsafetensors", "fastsafetensors fastsafe_open(device='cpu', nogds=True) + get_tensor",
         "O_DIRECT (its default on a local file system), 16 copy threads, 16 MiB bounce buffers (its defaults)",
         direct=True, env={"FASTSAFETENSORS_ODIRECT": "1"}),
    Peer("fastsafetensors-buffered", "fastsafetensors fastsafe_open(device='cpu', nogds=True) + get_tensor",
         "FASTSAFETENSORS_ODIRECT=0 (buffered reads), 16 copy threads, 16 MiB bounce buffers", direct=False,
         env={"FASTSAFETENSORS_ODIRECT": "0"}),
)
PEER_KEYS = tuple(p.key for p in PEERS)


def peer_by_key(key: str) -> Peer:
    for p in PEERS:
        if p.key == key:
            return p
    raise KeyError(key)


def family(key: str) -> str:
    """'runai-buffered' -> 'runai': the loader, whatever its settings."""
    return key.split("-", 1)[0]


def _package_root() -> str:
    """The directory holding this mmapckpt package, so that the peers' processes run the same code."""
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class _Worker:
    """The parent's end of one peer's process."""

    def __init__(self, peer: Peer, d: str, spec_path: str, threads: int) -> None:
        self.peer, self.log_path = peer, os.path.join(d, f"{peer.key}.log")
        env = {**os.environ, **peer.env}
        env["PYTHONPATH"] = os.pathsep.join(x for x in (_package_root(), env.get("PYTHONPATH")) if x)
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mmapckpt.bench.peer_worker", peer.key, d, spec_path, str(threads)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True, env=env)

    def answer(self, cmd: dict[str, Any] | None = None) -> dict[str, Any]:
        stdin, stdout = self.proc.stdin, self.proc.stdout
        if cmd is not None:
            try:
                stdin.write(json.dumps(cmd) + "\n")  # type: ignore[union-attr]
                stdin.flush()  # type: ignore[union-attr]
            except OSError:
                pass  # it ended: the empty read below says how
        ready, _, _ = select.select([stdout], [], [], _ANSWER_TIMEOUT_S)
        if not ready:  # a peer that hangs is reported like one that fails, and the run goes on
            self.proc.kill()
            self.proc.wait()
            return {"error": f"failed: no answer in {_ANSWER_TIMEOUT_S} s (killed): {self.log_tail()}"}
        line = stdout.readline()  # type: ignore[union-attr]
        if not line:
            self.proc.wait()
            return {"error": f"its process ended (exit status {self.proc.returncode}): {self.log_tail()}"}
        return json.loads(line)

    def log_tail(self) -> str:
        self._log.flush()
        with open(self.log_path, errors="replace") as f:
            lines = [ln.strip() for ln in f if ln.strip()]
        return (lines[-1] if lines else "no output")[:200]

    def strategy(self) -> str | None:
        """The read strategy Run:ai says it resolved (its log), or None."""
        with open(self.log_path, errors="replace") as f:
            found = re.findall(r"Filesystem strategy: (\S+)", f.read())
        return found[-1] if found else None

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()  # type: ignore[union-attr]  # its loop ends, and the process with it
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self._log.close()


class PeerRun:
    """The peers of one benchmark run: their processes, their files and what each row says.

    ``d`` is a directory of the run holding ``model.safetensors`` (written by :meth:`prepare`).
    """

    def __init__(self, peers: list[Peer], d: str, threads: int) -> None:
        self.peers, self.dir, self.threads = peers, d, threads
        self.workers: dict[str, _Worker] = {}
        self.info: dict[str, dict[str, Any]] = {}  # key -> label, settings, kind, O_DIRECT, reads, version
        self.failed: dict[str, str] = {}  # key -> why, in one line

    def prepare(self, sd: StateDict) -> None:
        """Write the source safetensors file and each peer's own file (untimed); start the peers."""
        from safetensors.torch import save_file

        from .peer_worker import digest
        from .system import fsync_path

        os.makedirs(self.dir, exist_ok=True)
        src = os.path.join(self.dir, "model.safetensors")
        save_file(sd, src)
        fsync_path(src)
        spec_path = os.path.join(self.dir, "spec.json")
        with open(spec_path, "w") as f:
            json.dump({k: [list(v.shape), str(v.dtype).removeprefix("torch."), digest(v)] for k, v in sd.items()}, f)
        for p in self.peers:
            w = _Worker(p, self.dir, spec_path, self.threads)
            self.workers[p.key] = w
            hello = w.answer()
            if "error" in hello:
                self._fail(p.key, hello["error"])
                continue
            ready = w.answer({"op": "setup"})
            if "error" in ready:
                self._fail(p.key, ready["error"])
                continue
            self.info[p.key] = {"label": p.label, "settings": p.settings, "kind": hello["kind"], "direct": p.direct,
                                "version": hello["version"], "reads": [os.path.basename(r) for r in ready["reads"]]}

    def _fail(self, key: str, why: str) -> None:
        self.failed[key] = why.splitlines()[0][:300] if why else "failed"
        self.info.pop(key, None)
        w = self.workers.pop(key, None)
        if w is not None:
            w.stop()

    def active(self) -> list[str]:
        return [p.key for p in self.peers if p.key in self.workers]

    def files(self, key: str) -> list[str]:
        return [os.path.join(self.dir, r) for r in self.info[key]["reads"]]

    def load(self, key: str, check: bool) -> tuple[float, bool | None] | None:
        """One timed load; (seconds, bitwise ok or None unchecked), or None if the peer failed (and is dropped)."""
        w = self.workers[key]
        out = w.answer({"op": "load", "check": check})
        if "error" in out:
            self._fail(key, out["error"])
            return None
        if out.get("num_readers") is not None:
            self.info[key]["num_readers"] = out["num_readers"]
        if key.startswith("runai") and "strategy" not in self.info[key]:
            self.info[key]["strategy"] = w.strategy()
        if check and not out["bitwise"]:
            self.info[key]["mismatch"] = out["mismatch"]
        return out["s"], (out["bitwise"] if check else None)

    def close(self) -> None:
        for w in self.workers.values():
            w.stop()
        self.workers.clear()
