"""Shared test utilities: bitwise comparison, real multi-process gloo runs, and stopping the processes a test starts."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import io
import json
import os
import signal
import struct
import subprocess
import tempfile
import traceback
import weakref
import zlib
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def tensor_bytes(t: torch.Tensor) -> bytes:
    """The tensor's bytes in C order (NaN payloads and -0.0 preserved)."""
    # clone, not contiguous(): a size-1 dim may keep a stride != 1, which view(uint8) refuses
    t = t.detach().cpu().resolve_conj().resolve_neg().clone(memory_format=torch.contiguous_format)
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()


def seeded_tensor(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A tensor of random bytes seeded by ``name`` (the same each run), bool as 0/1; a floating tensor of two
    or more elements starts with -0.0 and a NaN with every payload bit set, which a copy must keep."""
    n = dtype.itemsize
    for s in shape:
        n *= s
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    raw = bytearray(torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).numpy().tobytes())
    size = dtype.itemsize
    if dtype == torch.bool:
        raw = bytearray(b % 2 for b in raw)
    elif dtype.is_floating_point and n >= 2 * size:
        raw[0:size] = bytes(size - 1) + b"\x80"  # -0.0
        raw[size:2 * size] = b"\xff" * size  # a NaN with every payload bit set
    return torch.frombuffer(raw, dtype=dtype).reshape(shape).clone()


def assert_bitwise_equal(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), f"{what}: {type(a)} vs {type(b)}"
    assert a.dtype == b.dtype, f"{what}: dtype {a.dtype} != {b.dtype}"
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    assert tensor_bytes(a) == tensor_bytes(b), f"{what}: bytes differ"


def assert_tree_equal(a: Any, b: Any, what: str = "root") -> None:
    """Nested dicts/lists/tuples: tensors bitwise, everything else with ==."""
    if isinstance(a, torch.Tensor):
        assert_bitwise_equal(a, b, what)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{what}: keys {set(a)} != {set(b) if isinstance(b, dict) else b}"
        for k in a:
            assert_tree_equal(a[k], b[k], f"{what}.{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), f"{what}: {a!r} != {b!r}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_tree_equal(x, y, f"{what}[{i}]")
    else:
        assert a == b, f"{what}: {a!r} != {b!r}"


# --------------------------------------------------------------------------- processes: ranks and children
class RankFailed(Exception):
    """A rank function raised; the message is its traceback (the exception itself is dropped, see _entry)."""


def _entry(rank: int, fn: Callable, world_size: int, init_file: str, args: tuple, backend: str) -> None:
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    failure = None
    try:
        fn(rank, world_size, *args)
        dist.barrier()
    except BaseException:  # CheckpointException is a BaseException
        # kept as text: the exception's frames hold the rank's meshes and tensors, hence its process groups
        failure = traceback.format_exc()
    try:
        shutdown_process_groups()
    finally:
        if failure is not None:
            raise RankFailed(failure)


def shutdown_process_groups() -> None:
    """Destroy this rank's process groups and check that none outlives the call.

    A gloo group's worker threads must be joined while the interpreter still runs. One still
    alive at exit may drop its last finished Work (whose tensors own Python objects) after
    finalization began; Python then ends that thread with pthread_exit, whose unwinding through
    the Work's destructor calls std::terminate ("terminate called without an active exception",
    SIGABRT). ``destroy_process_group`` drops only torch's registries' references to a group.
    A DeviceMesh holds its groups too (``_pg_registry``), and meshes live on: in DTensor's
    caches (sharding propagation, redistribution plans, mesh topology, for the life of the
    process) and in unreachable cycles (an exception's traceback holding the frame that holds a
    mesh). So cycles are collected and every mesh left lets go of its groups first; whatever
    still holds a group after that is a leak of the rank function, and fails the rank.
    """
    from torch.distributed.device_mesh import DeviceMesh

    groups = [weakref.ref(pg) for pg in dist.distributed_c10d._world.pg_map]
    gc.collect()
    for obj in gc.get_objects():
        if issubclass(type(obj), DeviceMesh):  # not isinstance: no __class__ lookup (a dead weakproxy raises)
            obj._pg_registry.clear()  # a mesh is unusable once its groups are destroyed
    dist.destroy_process_group()
    alive = sum(r() is not None for r in groups)
    if alive:
        raise RuntimeError(f"{alive} process group(s) still referred to after destroy_process_group (a "
                           "ShardedTensor or a group kept beyond the rank function?): their threads would run "
                           "on into interpreter exit")


def run_distributed(fn: Callable, world_size: int, *args: Any, backend: str = "gloo") -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` real ranks (spawned processes).

    ``fn`` must be a module-level function (it is pickled by reference). Any rank's
    exception fails the call (torch.multiprocessing raises ProcessRaisedException). Every
    rank shuts its process groups down (``shutdown_process_groups``) before it exits, and
    every rank still running when this call ends, also on a failure or a test timeout, is
    killed by its pid. ``backend="nccl"`` gives rank r the CUDA device r.
    """
    fd, init_file = tempfile.mkstemp(prefix="mmapckpt-pg-")
    os.close(fd)
    os.unlink(init_file)  # the FileStore must start absent
    context = None
    try:
        context = mp.start_processes(_entry, args=(fn, world_size, init_file, args, backend), nprocs=world_size,
                                     join=False, start_method="spawn")
        while not context.join():
            pass
    finally:
        if context is not None:
            stop_processes(context.processes)
        if os.path.exists(init_file):
            os.unlink(init_file)


def _running(p: Any) -> bool:
    """Whether ``p`` has not exited yet, or has exited and is not reaped: either way its pid is still its own."""
    return p.poll() is None if isinstance(p, subprocess.Popen) else p.is_alive()


def stop_processes(procs: Iterable[Any]) -> None:
    """SIGKILL, by its pid, each of ``procs`` still running; then reap them all (and close their pipes).

    For a test's ``finally``: passed or failed, no process it started outlives it. Takes
    ``subprocess.Popen`` and ``multiprocessing.Process`` objects; an unstarted Process is skipped.
    """
    procs = [p for p in procs if p.pid is not None]
    for p in procs:
        if _running(p):  # not reaped yet, so the pid cannot belong to another process
            os.kill(p.pid, signal.SIGKILL)
    for p in procs:
        if isinstance(p, subprocess.Popen):
            p.wait()
            for f in (p.stdin, p.stdout, p.stderr):
                if f is not None:
                    with contextlib.suppress(OSError):
                        f.close()
        else:
            p.join()


def close_fork_server(proc: subprocess.Popen, child: int | None) -> None:
    """Stop a fork server (a process that forks one child per request and reaps it only when told) by pid.

    ``child`` is a child it started and was not told to reap, or None: its pid cannot have been
    reused, so it is killed first. Closing stdin then ends the server's loop; a server that does
    not exit within 60 s is killed.
    """
    try:
        if child is not None:
            os.kill(child, signal.SIGKILL)
        if proc.stdin is not None:
            with contextlib.suppress(OSError):
                proc.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=60)
    finally:
        stop_processes([proc])


# --------------------------------------------------------------------------- single-process DCP (core tests)
def dcp_failure(exc: BaseException, rank: int = 0) -> BaseException:
    """The original exception inside a CheckpointException (``failures[rank]``), else ``exc``.

    torch 2.13 stores either the exception or an ``(exception, traceback frames)`` pair.
    """
    failures = getattr(exc, "failures", None)
    if not failures:
        return exc
    f = failures[rank]
    return f[0] if isinstance(f, tuple) else f


def dcp_save(sd: Any, writer: Any) -> None:
    """``dcp.save(sd, storage_writer=writer, no_dist=True)``."""
    import torch.distributed.checkpoint as dcp

    dcp.save(sd, storage_writer=writer, no_dist=True)


def dcp_load(targets: Any, reader: Any) -> Any:
    """``dcp.load(targets, storage_reader=reader, no_dist=True)``; returns ``targets``."""
    import torch.distributed.checkpoint as dcp

    dcp.load(targets, storage_reader=reader, no_dist=True)
    return targets


# --------------------------------------------------------------------------- rewriting headers (hostile files)
def shard_with_header(data: bytes, doc: Any, *, compact: bool = False) -> bytes:
    """A shard's bytes with its header replaced by ``doc`` (checksum and length made to match);
    ``compact``: JSON without spaces, as the writer writes it (so that the same header still fits)."""
    body = json.dumps(doc, separators=(",", ":") if compact else None).encode()
    pre = bytearray(data[:32])
    pre[16:24] = struct.pack("<Q", len(body))
    pre[24:28] = struct.pack("<I", zlib.crc32(body))
    out = bytearray(data)
    out[:32] = pre
    out[32:32 + len(body)] = body
    return bytes(out)


def as_metadata_v1(directory: Any) -> None:
    """Rewrite a checkpoint's ``.metadata`` in the version-1 form (one JSON object per item and record)."""
    from mmapckpt.format.metadata import encode_metadata
    from mmapckpt.dcp.metadata import read_metadata_file
    from mmapckpt.storage.commits import read_user_metadata_file

    path = os.path.join(os.fspath(directory), ".metadata")
    _, md = read_metadata_file(path)
    data = encode_metadata(md, read_user_metadata_file(path), major=1)
    with open(path, "wb") as f:
        f.write(data)


def metadata_with_doc(data: bytes, doc: Any) -> bytes:
    """An mmapckpt .metadata file's bytes with its body replaced by ``doc`` (checksum and length made to match)."""
    body = json.dumps(doc).encode()
    return data[:12] + struct.pack("<IQ", zlib.crc32(body), len(body)) + body


# --------------------------------------------------------------------------- staging pipeline tests
def checksum_at_commit_planner() -> Any:
    """A DefaultLoadPlanner that records each target's bytes when commit_tensor is called (``.seen``)."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class ChecksumAtCommit(DefaultLoadPlanner):
        def __init__(self) -> None:
            super().__init__()
            self.seen: dict[str, bytes] = {}

        def commit_tensor(self, read_item: Any, tensor: torch.Tensor) -> None:
            self.seen[read_item.dest_index.fqn] = tensor_bytes(tensor)
            super().commit_tensor(read_item, tensor)

    return ChecksumAtCommit()


# --------------------------------------------------------------------------- a DCP stream transform of one's own
from torch.distributed.checkpoint._extension import StreamTransformExtension


class _Wrap(io.RawIOBase):
    """A stream that maps every byte through ``table`` on its way to/from ``inner``; ``extra`` bytes are
    appended on write and dropped on read (so the stored length differs from the value's)."""

    def __init__(self, inner, table: bytes, extra: bytes = b"", reading: bool = False):
        super().__init__()
        self.inner, self.table, self.extra, self.reading = inner, table, extra, reading
        self._buf = b""

    def writable(self):
        return not self.reading

    def readable(self):
        return self.reading

    def write(self, b):
        data = bytes(b)
        self.inner.write(data.translate(self.table))
        return len(data)

    def close(self):
        if not self.reading and not self.closed:
            self.inner.write(self.extra)
            self.inner.flush()
            self.inner.close()
        super().close()

    def readinto(self, b):
        if not self._buf:
            self._buf = self.inner.read(1 << 16)
            if self.extra and len(self._buf) < (1 << 16):  # the last piece: drop the trailer
                rest = self.inner.read()
                self._buf += rest
                self._buf = self._buf.removesuffix(self.extra)
        n = min(len(b), len(self._buf))
        b[:n] = self._buf[:n].translate(self.table)
        self._buf = self._buf[n:]
        return n


class Invert(StreamTransformExtension):
    """Flips every bit and appends a 7-byte trailer: a transform of one's own, not length-preserving."""

    TABLE = bytes(255 - i for i in range(256))
    TRAILER = b"INVERT!"

    @staticmethod
    def registry_name():
        return "test.invert"

    @staticmethod
    def from_descriptor(version):
        return Invert()

    def get_descriptor(self):
        return "test.invert/1"

    def transform_to(self, output):
        return _Wrap(output, self.TABLE, self.TRAILER)

    def transform_from(self, input):
        return _Wrap(input, self.TABLE, self.TRAILER, reading=True)


def invert_registry() -> Any:
    """DCP's default registry with :class:`Invert` registered."""
    from torch.distributed.checkpoint._extension import ExtensionRegistry

    reg = ExtensionRegistry()
    reg.register(Invert)
    return reg


# --------------------------------------------------------------------------- chunk layouts of one's choosing
Chunk = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes) in the global tensor


def chunk_planner(layouts: dict[str, list[Chunk]]) -> Any:
    """A DefaultSavePlanner that stores each tensor named in ``layouts`` as exactly those chunks
    (each holding the tensor's values at its place), with DCP's check of the global plan skipped,
    so that gaps, overlaps and out-of-order layouts reach the files as a buggy or hostile writer
    would leave them. Tensors not named are stored as DCP stores them."""
    from torch.distributed.checkpoint.default_planner import (DefaultSavePlanner,
                                                              create_default_global_save_plan)
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    class ChunkPlanner(DefaultSavePlanner):
        def __init__(self) -> None:
            super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False, dedup_save_to_lowest_rank=True)

        def create_local_plan(self):  # type: ignore[override]
            plan = super().create_local_plan()
            items = [i for i in plan.items if i.index.fqn not in layouts]
            for fqn, chunks in layouts.items():
                t = self.state_dict[fqn]
                for off, sz in chunks:
                    items.append(WriteItem(index=MetadataIndex(fqn, torch.Size(off)), type=WriteItemType.SHARD,
                                           tensor_data=TensorWriteData(
                                               chunk=ChunkStorageMetadata(torch.Size(off), torch.Size(sz)),
                                               properties=TensorProperties.create_from_tensor(t), size=t.size())))
            self.plan = dataclasses.replace(plan, items=items)
            return self.plan

        def _create_global_plan(self, all_plans):  # type: ignore[override]
            return create_default_global_save_plan(self._dedup_save_plans(all_plans))

        def resolve_data(self, item):  # type: ignore[override]
            if item.index.fqn not in layouts:
                return super().resolve_data(item)
            t = self.state_dict[item.index.fqn]
            for d, (o, s) in enumerate(zip(item.index.offset, item.tensor_data.chunk.sizes)):
                t = t.narrow(d, o, s)
            return t.contiguous()

    return ChunkPlanner()


def save_chunked(sd: dict[str, torch.Tensor], layouts: dict[str, list[Chunk]], writer: Any) -> None:
    """``dcp.save`` of ``sd`` with the tensors of ``layouts`` stored as exactly those chunks (one process)."""
    import torch.distributed.checkpoint as dcp

    dcp.save(sd, storage_writer=writer, planner=chunk_planner(layouts), no_dist=True)


# --------------------------------------------------------------------------- files that are not the checkpoint's
#: a user's own files beside a checkpoint (configs, notes), which no save or conversion may touch
FOREIGN = {"config.json": b'{"model_type": "llama"}', "notes.txt": b"run 7\n"}


def add_foreign(d: str) -> None:
    """Put :data:`FOREIGN`'s files into directory ``d``."""
    for name, data in FOREIGN.items():
        with open(os.path.join(d, name), "wb") as f:
            f.write(data)


def foreign_kept(d: str) -> bool:
    """Whether :data:`FOREIGN`'s files are in ``d``, byte for byte."""
    return all(open(os.path.join(d, n), "rb").read() == data for n, data in FOREIGN.items())


# --------------------------------------------------------------------------- small filesystems (full-disk tests)
@contextlib.contextmanager
def mounted(argv: list[str], d: str, what: str) -> Any:
    """Run the ``mount`` command ``argv`` (which mounts at ``d``), yield ``d``, then unmount it (lazily if
    busy). Skips the test where mounting fails (no root, no mount rights)."""
    import pytest

    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        pytest.skip(f"cannot mount a {what}: {e}")
    if r.returncode != 0:
        pytest.skip(f"cannot mount a {what}: {r.stderr.strip()}")
    try:
        yield d
    finally:
        gc.collect()  # drop mappings of files on it
        if subprocess.run(["umount", d], capture_output=True, timeout=60).returncode != 0:
            subprocess.run(["umount", "-l", d], capture_output=True, timeout=60)


def refuse_o_direct(monkeypatch: Any) -> None:
    """Make the cold reads' O_DIRECT opens fail with EINVAL, as a tmpfs answered before Linux 6.6 (since then it
    takes O_DIRECT, so the refusal is simulated)."""
    import errno

    from mmapckpt.io import cold_reads

    real_open = os.open

    def no_direct(path: Any, flags: int, *args: Any) -> int:
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(cold_reads.os, "open", no_direct)


BENCHMARKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "benchmarks")


def bench_script(name: str) -> Any:
    """``benchmarks/NAME.py`` (a script outside the package) imported by path, as module ``benchmarks_NAME``."""
    import importlib.util
    import sys

    module = f"benchmarks_{name}"
    if module in sys.modules:
        return sys.modules[module]
    spec = importlib.util.spec_from_file_location(module, os.path.join(BENCHMARKS, f"{name}.py"))
    assert spec is not None and spec.loader is not None, name
    mod = importlib.util.module_from_spec(spec)
    sys.modules[module] = mod  # dataclasses and pickling look the module up by name
    spec.loader.exec_module(mod)
    return mod


def check_objstore_bench(doc: dict[str, Any], fsspec: str) -> None:
    """What a quick ``benchmarks/objstore_bench.py`` run on a store must give (its JSON ``doc``): every mmapckpt
    row and the cache's rows measured, the cold loads as a fraction of the GET limit, both limits, each load
    bitwise, 4 processes together fetching each byte once, and DCP's fsspec rows or why not (``fsspec``)."""
    rows = doc["rows"]
    for row in ("save: dcp.save + MmapWriter", "load: mmapckpt.load_into", "load: dcp.load + MmapReader",
                "load: dcp.load + MmapReader + FastLoadPlanner", "load: mmapckpt.load (new tensors)",
                "load: load_into, cache cold"):
        assert rows[row]["gb_per_s"] > 0 and "of_limit" in rows[row], row
    for row in ("load: load_into, cache warm", "load: load_into, local disk warm",
                "load: 4 processes, one URL, cache cold"):
        assert rows[row]["gb_per_s"] > 0, row
    assert doc["limits"]["get"].startswith("limit: GET") and doc["limits"]["put"].startswith("limit: PUT")
    assert doc["correct"] and all(doc["correct"].values()), doc["correct"]
    assert "load: 4 processes, one URL, cache cold" in doc["correct"]
    assert doc["cache"]["fetched_of_size_together"] == 1.0  # each byte fetched once across the processes
    assert doc["server_pids_found"]  # the fixture's server runs here: its CPU is counted
    assert "DCP FsspecWriter/FsspecReader" in rows or f"load: dcp.load + FsspecReader ({fsspec})" in rows
