"""The saved data and the child side of the overwrite tests (tests/reliability/test_overwrite.py).

Two *layouts* of a state dict: "A" (a few float32 matrices, saved over 3 shard files) and
"B" (more tensors, other shapes and dtypes: bf16, fp16, fp8, int8/int32, float64, bool, a
0-dim and a zero-size tensor, NaN payloads and -0.0; saved over 2 shard files). A save over
a checkpoint of one layout always writes the other, so the old and the new checkpoint have
different keys, shapes and file counts, and every tensor of every version has other bytes.

Versions are cheap: the random base bytes of each layout are drawn once (seeded) and a
version XORs every element with a key derived from (version, tensor), so the parent, the fork
server and every forked child build bit-identical data without re-drawing it.

``server_main`` is a fork server: torch is imported and the bases are drawn once; each save
runs in a fresh forked child that can SIGKILL itself before a chosen file-system call
(``kill_at`` = index of the call, or ``kill_rule`` = the n-th call of a kind), or block inside
``write_data`` / before the commit until a file appears (to hold the save's lock).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from typing import Any

import torch

# ---------------------------------------------------------------------------- the data
#: layout -> [(name, shape builder(n), dtype)] where n scales with the size in MiB
_MASK64 = (1 << 64) - 1


def _spec(layout: str, mb: int) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    unit = max(1, mb * 2**20 // 64)  # bytes per 1/64 of the total
    if layout == "A":
        rows = max(1, unit * 10 // 4 // 1024)
        return [(f"model.layer{i}.weight", (rows, 1024), torch.float32) for i in range(6)] + [
            ("version", (1,), torch.int64)]
    if layout == "B":
        k = max(1, unit * 6 // 4 // (64 * 128))
        return [
            ("enc.block0.attn", (k, 64, 128), torch.float32),
            ("enc.block1.attn", (k, 64, 128), torch.float32),
            ("enc.block2.mlp", (2 * k, 128, 64), torch.float32),
            ("enc.emb.bf16", (max(1, unit * 14 // 2 // 768), 768), torch.bfloat16),
            ("enc.proj.fp16", (max(1, unit * 8 // 2 // 512), 512), torch.float16),
            ("opt.exp_avg.f64", (max(1, unit * 6 // 8),), torch.float64),
            ("opt.count.i32", (max(1, unit * 4 // 4 // 3), 3), torch.int32),
            ("quant.i8", (max(1, unit * 2 // 5), 5), torch.int8),
            ("quant.fp8", (4099,), torch.float8_e4m3fn),
            ("mask.bool", (1001,), torch.bool),
            ("empty", (0, 7), torch.float32),
            ("scalar", (), torch.float64),
            ("special", (6,), torch.float32),
            ("version", (1,), torch.int64),
        ]
    raise ValueError(layout)


THREADS = {"A": 3, "B": 2}
_BASES: dict[tuple[str, int], dict[str, torch.Tensor]] = {}
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def other(layout: str) -> str:
    return "B" if layout == "A" else "A"


def base_state(layout: str, mb: int) -> dict[str, torch.Tensor]:
    """The seeded random base of a layout (drawn once per process, then cached)."""
    key = (layout, mb)
    if key not in _BASES:
        g = torch.Generator().manual_seed(1_000_003 * (1 + (layout == "B")) + mb)
        out = {}
        for name, shape, dtype in _spec(layout, mb):
            n = 1
            for s in shape:
                n *= s
            if dtype == torch.bool:
                out[name] = torch.randint(0, 2, shape, generator=g, dtype=torch.uint8).bool()
                continue
            size = torch.tensor([], dtype=dtype).element_size()
            raw = torch.randint(-2**63, 2**63 - 1, ((n * size + 7) // 8,), generator=g, dtype=torch.int64)
            out[name] = raw.view(torch.uint8)[: n * size].view(dtype).reshape(shape).clone()
        _BASES[key] = out
    return _BASES[key]


def _key(version: int, idx: int, size: int) -> int:
    """A nonzero XOR key for (version, tensor), as a signed integer of ``size`` bytes."""
    x = (version * 0x9E3779B97F4A7C15 + (idx + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    x ^= x >> 31
    x = (x * 0x94D049BB133111EB) & _MASK64
    x ^= x >> 29
    bits = 8 * size
    k = x & ((1 << bits) - 1) or 1
    return k - (1 << bits) if k >= 1 << (bits - 1) else k


def make_state(version: int, layout: str, mb: int, objects: bool = True) -> dict[str, Any]:
    """Version ``version`` of ``layout``: every element differs from every other version's (bitwise)."""
    sd: dict[str, Any] = {}
    for idx, (name, t) in enumerate(base_state(layout, mb).items()):
        v = t.clone()
        if name == "version":
            v.fill_(version)
        elif name == "special":  # NaNs with payloads, -0.0, inf, a subnormal
            bits = [0x7FC00001 + version, 0xFFC00002, 0x80000000, 0x7F800000, 0x00000001, version]
            v = torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)
        elif v.dtype == torch.bool:
            if version % 2:
                v = ~v
        elif v.numel():
            size = v.element_size()
            v.view(_INT_VIEW[size]).bitwise_xor_(_key(version, idx, size))
        sd[name] = v
    if objects:  # non-tensor values: BYTE_IO entries (dcp.save only; mmapckpt.save takes tensors)
        sd["step"] = version
        sd["note"] = f"layout {layout} version {version}"
    return sd


# ---------------------------------------------------------------------------- the killer
_COMMITS = (".metadata", "__0.metadata")


class Killer:
    """Counts file-system calls of the save; SIGKILLs the process before the chosen one.

    ``kill_at``: the index of the call; ``rule``: {"name": "pwrite", "match": ".distcp",
    "nth": 0, "after_commit": False} = the nth call of that kind on a path containing
    ``match`` (after the commit rename when ``after_commit``). A pwrite writes half of its
    buffer before the kill.
    """

    def __init__(self, kill_at: int = -1, rule: dict[str, Any] | None = None) -> None:
        self.kill_at, self.rule = kill_at, rule
        self.events: list[str] = []
        self.armed = False
        self.committed = False
        self.matched = 0
        self._lock = threading.Lock()  # writer threads call hit() at once: counting and deciding are one step

    def _should_kill(self, name: str, where: str) -> bool:
        if self.kill_at >= 0:
            return len(self.events) == self.kill_at
        r = self.rule
        if not r or name != r["name"] or r.get("match", "") not in where:
            return False
        if r.get("after_commit") and not self.committed:
            return False
        self.matched += 1
        return self.matched - 1 == r.get("nth", 0)

    def hit(self, name: str, where: str = "", partial: Any = None, dst: str = "") -> None:
        if not self.armed:
            return
        with self._lock:
            if self._should_kill(name, where):
                if partial is not None:
                    partial()
                os.kill(os.getpid(), signal.SIGKILL)
            self.events.append(f"{name}:{where}" + (f"->{os.path.basename(dst)}" if dst else ""))
            if name in ("replace", "rename") and os.path.basename(dst) in _COMMITS:
                self.committed = True


def _fd_name(fd: int) -> str:
    try:
        return os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))
    except OSError:
        return "?"


def install(k: Killer) -> None:
    names = ("pwrite", "pwritev", "write", "fsync", "fdatasync", "replace", "rename", "link", "unlink", "remove",
             "rmdir", "ftruncate", "open")
    real = {n: getattr(os, n) for n in names}

    def pwrite(fd: int, data: Any, off: int) -> int:
        def half() -> None:
            mv = memoryview(data).cast("B")
            try:
                real["pwrite"](fd, mv[: (len(mv) // 2) & ~4095 or len(mv) // 2], off)
            except OSError:
                pass
        k.hit("pwrite", _fd_name(fd), half)
        return real["pwrite"](fd, data, off)

    def opener(path: Any, flags: int, *a: Any, **kw: Any) -> int:
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            k.hit("open", os.path.basename(os.fspath(path)))
        return real["open"](path, flags, *a, **kw)

    def on_fd(name: str) -> Any:
        def f(fd: int, *a: Any, **kw: Any) -> Any:
            k.hit(name, _fd_name(fd))
            return real[name](fd, *a, **kw)
        return f

    def on_path(name: str) -> Any:
        def f(src: Any, *a: Any, **kw: Any) -> Any:
            dst = os.fspath(a[0]) if a and isinstance(a[0], (str, bytes, os.PathLike)) else ""
            k.hit(name, os.path.basename(os.fspath(src)) if not isinstance(src, int) else _fd_name(src), dst=dst)
            return real[name](src, *a, **kw)
        return f

    os.pwrite, os.open = pwrite, opener  # type: ignore[assignment]
    for n in ("pwritev", "write", "fsync", "fdatasync", "ftruncate"):
        setattr(os, n, on_fd(n))
    for n in ("replace", "rename", "link", "unlink", "remove", "rmdir"):
        setattr(os, n, on_path(n))


# ---------------------------------------------------------------------------- saves in the child
def _blocking_writer(block: str, go: str) -> type:
    import mmapckpt

    def wait() -> None:
        print("BLOCKED", flush=True)
        deadline = time.monotonic() + 120
        while not os.path.exists(go):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{go} never appeared")
            time.sleep(0.01)

    class Blocking(mmapckpt.MmapWriter):
        def write_data(self, plan: Any, planner: Any) -> Any:
            if block == "write_data":
                wait()
            return super().write_data(plan, planner)

        def finish(self, metadata: Any, results: Any) -> None:
            if block == "finish":
                wait()
            super().finish(metadata, results)

    return Blocking


def save(cmd: dict[str, Any], killer: Killer | None = None) -> float:
    """Run one save as ``cmd`` says; return its duration in seconds (from just before the save call)."""
    import torch.distributed.checkpoint as dcp

    import mmapckpt

    op, path, layout, mb = cmd["op"], cmd["path"], cmd["layout"], cmd["mb"]
    threads = cmd.get("threads") or THREADS[layout]
    sd = make_state(cmd["version"], layout, mb, objects=op != "save")
    writer_cls = _blocking_writer(cmd["block"], cmd["go"]) if cmd.get("block") else mmapckpt.MmapWriter
    if killer is not None:
        install(killer)
    print("READY", flush=True)
    t0 = time.perf_counter()
    if killer is not None:
        killer.armed = True
    if op == "save":
        mmapckpt.save(sd, path, thread_count=threads)
    elif op == "dcp":
        dcp.save(sd, storage_writer=writer_cls(path, thread_count=threads), no_dist=True)
    elif op == "dcp_nocoll":
        dcp.save(sd, storage_writer=writer_cls(path, thread_count=threads), no_dist=True, use_collectives=False)
    else:
        raise ValueError(op)
    if killer is not None:
        killer.armed = False
    return time.perf_counter() - t0


def _child(cmd: dict[str, Any]) -> None:
    torch.set_num_threads(1)
    killer = Killer(cmd.get("kill_at", -1), cmd.get("kill_rule"))
    seconds = save(cmd, killer)
    print("DONE", json.dumps({"seconds": seconds, "events": killer.events}), flush=True)


def server_main() -> None:
    """Reads one JSON command per line; answers ``PID n``, the child's lines, then ``EXIT code``.

    The child is reaped only when the client sends a line, so its pid stays valid for a kill.
    """
    import warnings

    import torch.distributed.checkpoint  # noqa: F401  (imported before forking)

    import mmapckpt  # noqa: F401

    warnings.simplefilter("ignore")
    for line in sys.stdin:
        cmd = json.loads(line)
        base_state("A", cmd["mb"]), base_state("B", cmd["mb"])  # drawn once, inherited by every child
        go_r, go_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                os.close(go_w)
                os.read(go_r, 1)
                _child(cmd)
            except BaseException:
                import traceback
                traceback.print_exc()
                code = 1
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        print("PID", pid, flush=True)
        os.close(go_r)
        os.write(go_w, b"g")
        os.close(go_w)
        sys.stdin.readline()
        _, status = os.waitpid(pid, 0)
        print("EXIT", os.waitstatus_to_exitcode(status), flush=True)
