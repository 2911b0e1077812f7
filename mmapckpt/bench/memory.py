"""Resident memory of one load into preallocated targets, measured in a fresh process.

Run as ``python -m mmapckpt.bench.memory METHOD CHECKPOINT SPEC.json``; prints one
JSON object. The targets are allocated and touched first, so the figures are what
the load adds on top of them:

- ``peak_rss_added``: VmHWM (reset through /proc/self/clear_refs) minus VmRSS before
  the load; it counts mapped file pages too, which the kernel can drop at will;
- ``peak_anon_added``: the highest RssAnon sampled every millisecond during the
  load, minus RssAnon before it: memory that only this process holds;
- ``anon_added_after``: RssAnon after the load minus before.
"""

from __future__ import annotations

import gc
import json
import sys
import threading
import time

import torch

__all__ = ["measure", "read_status"]

_FIELDS = ("VmRSS", "VmHWM", "RssAnon", "RssFile")


def read_status() -> dict[str, int]:
    """The process's memory counters from /proc/self/status, in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name in _FIELDS:
                out[name] = int(rest.split()[0]) * 1024
    return out


class _AnonSampler(threading.Thread):
    """Samples RssAnon until stopped and keeps the highest value."""

    def __init__(self, interval: float = 0.001) -> None:
        super().__init__(daemon=True)
        self.interval, self.peak, self._stop_event = interval, 0, threading.Event()

    def run(self) -> None:
        while not self._stop_event.is_set():
            self.peak = max(self.peak, read_status().get("RssAnon", 0))
            time.sleep(self.interval)

    def stop(self) -> int:
        self._stop_event.set()
        self.join()
        return max(self.peak, read_status().get("RssAnon", 0))


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # 5: reset the peak RSS (VmHWM) to the current RSS
        return True
    except OSError:
        return False


def measure(method_key: str, path: str, spec: dict[str, list]) -> dict[str, object]:
    """Load ``path`` with ``method_key`` into fresh targets shaped by ``spec`` and report memory."""
    from .methods import method_by_key

    method = method_by_key(method_key)
    targets = {k: torch.empty(shape, dtype=getattr(torch, dt)) for k, (shape, dt) in spec.items()}
    for t in targets.values():
        t.zero_()  # touch every page: the targets are resident before the load starts
    import safetensors.torch as _st  # noqa: F401  imports are not what the load adds
    import torch.distributed.checkpoint as _dcp  # noqa: F401

    gc.collect()
    before = read_status()
    hwm_reset = _reset_peak()
    sampler = _AnonSampler()
    sampler.start()
    t0 = time.perf_counter()
    method.load_into(targets, path)
    seconds = time.perf_counter() - t0
    peak_anon = sampler.stop()
    after = read_status()
    return {
        "method": method_key,
        "seconds": seconds,
        "targets_bytes": sum(t.nbytes for t in targets.values()),
        "rss_before": before.get("VmRSS"),
        "peak_rss_added": (after["VmHWM"] - before["VmRSS"]) if hwm_reset and "VmHWM" in after else None,
        "peak_anon_added": peak_anon - before.get("RssAnon", 0),
        "anon_added_after": after.get("RssAnon", 0) - before.get("RssAnon", 0),
    }


def main(argv: list[str]) -> int:
    method_key, path, spec_path = argv
    with open(spec_path) as f:
        spec = json.load(f)
    print(json.dumps(measure(method_key, path, spec)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
