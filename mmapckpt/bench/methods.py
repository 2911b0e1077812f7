"""The methods the benchmark compares, each as save / load-into-targets / lazy-open callables.

Every save is durable: methods that do not fsync by themselves (safetensors,
torch.save) get their file and directory fsynced inside the timed call, as a
checkpoint needs.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.planner import LoadItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from ..dcp.reader import MmapReader
from ..dcp.writer import MmapWriter
from ..format.entries import paused_gc
from .system import fsync_path

__all__ = ["Method", "METHODS", "EXTRA_METHODS", "method_by_key", "lazy_note", "ScanOps", "SCAN_METHODS", "scan_ops"]

StateDict = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Method:
    """One way to save and load a state dict; ``path`` is the method's own directory."""

    key: str
    label: str
    save: Callable[[StateDict, str], object]
    load_into: Callable[[StateDict, str], None]
    lazy: Callable[[str], StateDict] | None
    lazy_label: str = ""
    #: whether its loads read with O_DIRECT (the loads' rows say so beside the peers')
    direct: bool = False


def _quiet(fn: Callable[[], object]) -> object:
    with warnings.catch_warnings():  # dcp warns about no_dist and about its own deprecations
        warnings.simplefilter("ignore")
        return fn()


# ---------------------------------------------------------------- mmapckpt
def _mmap_save(sd: StateDict, path: str) -> MmapWriter:
    w = MmapWriter(path)
    _quiet(lambda: dcp.save(sd, storage_writer=w, no_dist=True))
    return w


def _mmap_load(targets: StateDict, path: str) -> None:
    _quiet(lambda: dcp.load(targets, storage_reader=MmapReader(path), no_dist=True))


def _mmap_lazy_fn() -> Callable[[str], StateDict] | None:
    try:
        from .. import lazy
    except ImportError:
        return None
    fn = getattr(lazy, "load", None)
    return fn if callable(fn) else None


def lazy_note() -> str | None:
    """Why mmapckpt's lazy row is missing, or None when mmapckpt.lazy.load exists."""
    return None if _mmap_lazy_fn() is not None else "mmapckpt.lazy.load does not exist in this version: row skipped"


def _mmap_lazy(path: str) -> StateDict:
    fn = _mmap_lazy_fn()
    if fn is None:
        raise RuntimeError(lazy_note())
    return fn(path)


def _base_save(sd: StateDict, path: str) -> MmapWriter:
    w = MmapWriter(path, direct_io=False)
    _quiet(lambda: dcp.save(sd, storage_writer=w, no_dist=True))
    return w


def _base_load(targets: StateDict, path: str) -> None:
    _quiet(lambda: dcp.load(targets, storage_reader=MmapReader(path, direct_reads=False), no_dist=True))


# ---------------------------------------------------------------- mmapckpt without DCP planning
def _api_save(sd: StateDict, path: str) -> MmapWriter:
    from ..saving import save

    return save(sd, path)


def _api_load(targets: StateDict, path: str) -> None:
    from ..into import load_into

    load_into(targets, path)


def _fast_save(sd: StateDict, path: str) -> MmapWriter:
    from ..dcp.fast_planner import FastSavePlanner

    w = MmapWriter(path)
    _quiet(lambda: dcp.save(sd, storage_writer=w, planner=FastSavePlanner(), no_dist=True))
    return w


def _fast_load(targets: StateDict, path: str) -> None:
    from ..dcp.fast_planner import FastLoadPlanner

    _quiet(lambda: dcp.load(targets, storage_reader=MmapReader(path), planner=FastLoadPlanner(), no_dist=True))


class _PlanningOnly(MmapReader):
    """MmapReader whose ``read_data`` resolves and commits every item without reading or copying.

    A ``dcp.load`` through it costs DCP's own work, the planner's and the metadata decode,
    and nothing of the reader's copies: the scan's "plan" phase, which it reports apart from
    the reader's own cost (the warm load's time less this).
    """

    def read_data(self, plan, planner):  # type: ignore[no-untyped-def]
        with paused_gc():  # as MmapReader.read_data
            for item in plan.items:
                if item.type == LoadItemType.BYTE_IO:
                    continue  # a stored value: nothing to resolve without reading it
                planner.commit_tensor(item, planner.resolve_tensor(item))
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut


class _NoWrites(StorageWriter):
    """A storage writer that writes nothing: ``dcp.save`` through it costs DCP's own work and the planner's.

    The scan's "plan_save" phase (resolving each item's data included, as a writer must),
    reported apart from the writer's own cost (the save's time less this).
    """

    def reset(self, checkpoint_id=None):  # type: ignore[no-untyped-def]
        pass

    def set_up_storage_writer(self, is_coordinator, *args, **kwargs):  # type: ignore[no-untyped-def]
        pass

    def prepare_local_plan(self, plan):  # type: ignore[no-untyped-def]
        return plan

    def prepare_global_plan(self, plans):  # type: ignore[no-untyped-def]
        return plans

    def write_data(self, plan, planner):  # type: ignore[no-untyped-def]
        results = []
        for item in plan.items:
            data = planner.resolve_data(item)
            n = data.nbytes if isinstance(data, torch.Tensor) else len(data.getbuffer())
            results.append(WriteResult(index=item.index, size_in_bytes=n, storage_data=None))
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata, results):  # type: ignore[no-untyped-def]
        pass

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id):  # type: ignore[no-untyped-def]
        return True


def _mmap_plan_save(sd: StateDict, path: str) -> None:
    _quiet(lambda: dcp.save(sd, storage_writer=_NoWrites(), no_dist=True))


def _fast_plan_save(sd: StateDict, path: str) -> None:
    from ..dcp.fast_planner import FastSavePlanner

    _quiet(lambda: dcp.save(sd, storage_writer=_NoWrites(), planner=FastSavePlanner(), no_dist=True))


def _under_model(fn: Callable[[StateDict, str], object]) -> Callable[[StateDict, str], object]:
    """``fn`` given ``{"model": sd}``: one top-level key, as DCP is usually called (DCP's own
    per-key work, a logging wrapper and ``Stateful`` checks, runs once per top-level key)."""
    return lambda sd, path: fn({"model": sd}, path)  # type: ignore[dict-item]


def _mmap_plan(targets: StateDict, path: str) -> None:
    _quiet(lambda: dcp.load(targets, storage_reader=_PlanningOnly(path), no_dist=True))


def _fast_plan(targets: StateDict, path: str) -> None:
    from ..dcp.fast_planner import FastLoadPlanner

    _quiet(lambda: dcp.load(targets, storage_reader=_PlanningOnly(path), planner=FastLoadPlanner(), no_dist=True))


# ---------------------------------------------------------------- stock DCP
def _dcp_save(sd: StateDict, path: str) -> None:
    _quiet(lambda: dcp.save(sd, storage_writer=dcp.FileSystemWriter(path, sync_files=True), no_dist=True))


def _dcp_load(targets: StateDict, path: str) -> None:
    _quiet(lambda: dcp.load(targets, storage_reader=dcp.FileSystemReader(path), no_dist=True))


# ---------------------------------------------------------------- safetensors
def _st_file(path: str) -> str:
    return os.path.join(path, "model.safetensors")


def _st_save(sd: StateDict, path: str) -> None:
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    save_file(sd, _st_file(path))
    fsync_path(_st_file(path))
    fsync_path(path)


def _st_load(targets: StateDict, path: str) -> None:
    from safetensors import safe_open

    with safe_open(_st_file(path), framework="pt") as f:
        for k in f.keys():
            targets[k].copy_(f.get_tensor(k))


def _st_lazy(path: str) -> StateDict:
    from safetensors.torch import load_file

    return load_file(_st_file(path))


def _st_load_file_into(targets: StateDict, path: str) -> None:
    for k, v in _st_lazy(path).items():
        targets[k].copy_(v)


def _st_open_all(path: str) -> int:
    from safetensors import safe_open

    with safe_open(_st_file(path), framework="pt") as f:
        return sum(1 for k in f.keys() if f.get_tensor(k) is not None)


def _api_open_all(path: str) -> int:
    from ..lazy import open as open_ckpt

    with open_ckpt(path) as f:
        return sum(1 for k in f.keys() if f.get_tensor(k) is not None)


# ---------------------------------------------------------------- torch.save
def _pt_file(path: str) -> str:
    return os.path.join(path, "model.pt")


def _pt_save(sd: StateDict, path: str) -> None:
    os.makedirs(path, exist_ok=True)
    torch.save(sd, _pt_file(path))
    fsync_path(_pt_file(path))
    fsync_path(path)


def _pt_lazy(path: str) -> StateDict:
    return torch.load(_pt_file(path), mmap=True, weights_only=True)


def _pt_load(targets: StateDict, path: str) -> None:
    for k, v in _pt_lazy(path).items():
        targets[k].copy_(v)


METHODS: tuple[Method, ...] = (
    Method("mmapckpt", "mmapckpt (MmapWriter/MmapReader)", _mmap_save, _mmap_load, _mmap_lazy, "mmapckpt.load"),
    Method("mmapckpt-api", "mmapckpt.save / mmapckpt.load_into (one process, no DCP planning)", _api_save, _api_load,
           None),
    Method("mmapckpt-fast", "mmapckpt with FastSavePlanner/FastLoadPlanner", _fast_save, _fast_load, None),
    Method("dcp", "stock DCP (FileSystemWriter/Reader)", _dcp_save, _dcp_load, None),
    Method("safetensors", "safetensors (save_file/safe_open)", _st_save, _st_load, _st_lazy,
           "safetensors load_file"),
    Method("torch", "torch.save/torch.load(mmap=True)", _pt_save, _pt_load, _pt_lazy, "torch.load(mmap=True)"),
)


#: Selected only by name (``--methods``): mmapckpt with its fast paths off (buffered writes,
#: copies out of the mapping), to show in one run what the fast paths move.
EXTRA_METHODS: tuple[Method, ...] = (
    Method("mmapckpt-base", "mmapckpt, buffered writes and mapped copies", _base_save, _base_load, None),
    Method("mmapckpt-fast-model", "mmapckpt with the fast planners, the state dict as {'model': sd}",
           _under_model(_fast_save), _under_model(_fast_load), None),
)


def method_by_key(key: str) -> Method:
    for m in METHODS + EXTRA_METHODS:
        if m.key == key:
            return m
    raise KeyError(f"unknown benchmark method {key!r}; known: {[m.key for m in METHODS]}")


@dataclass(frozen=True)
class ScanOps:
    """What the tensor-count scan times for one method: phase -> (label, callable).

    Phases: ``save`` (durable), ``warm`` (a warm load into existing targets), ``lazy``
    (the whole state dict as new tensors), ``open`` (open, then every ``get_tensor``) and,
    for ``dcp.load``, ``plan`` (the warm load through a reader that resolves and commits
    without copying: DCP's planning, the planner's and the metadata decode) and for
    ``dcp.save``, ``plan_save`` (the save through a writer that writes nothing).
    ``nested``: the method takes the nested state dict (DCP); otherwise a flat
    ``{name: tensor}`` dict of its tensors only (safetensors and mmapckpt.save hold no other values).
    """

    key: str
    nested: bool
    ops: dict[str, tuple[str, Callable]]


_SCAN_OPS: tuple[ScanOps, ...] = (
    ScanOps("safetensors", False, {"save": ("save_file", _st_save), "warm": ("load_file + copy_", _st_load_file_into),
                                   "lazy": ("load_file", _st_lazy), "open": ("safe_open + get_tensor", _st_open_all)}),
    ScanOps("mmapckpt-api", False, {"save": ("mmapckpt.save", _api_save), "warm": ("mmapckpt.load_into", _api_load),
                                    "lazy": ("mmapckpt.load", _mmap_lazy),
                                    "open": ("mmapckpt.open + get_tensor", _api_open_all)}),
    ScanOps("mmapckpt-fast", True, {"save": ("dcp.save, MmapWriter, FastSavePlanner", _fast_save),
                                    "warm": ("dcp.load, MmapReader, FastLoadPlanner", _fast_load),
                                    "plan": ("dcp.load, no-copy reader, FastLoadPlanner", _fast_plan),
                                    "plan_save": ("dcp.save, no-write writer, FastSavePlanner", _fast_plan_save)}),
    ScanOps("mmapckpt-fast-model", True, {
        "save": ("dcp.save {model: sd}, FastSavePlanner", _under_model(_fast_save)),
        "warm": ("dcp.load {model: sd}, FastLoadPlanner", _under_model(_fast_load)),
        "plan": ("dcp.load {model: sd}, no-copy reader", _under_model(_fast_plan)),
        "plan_save": ("dcp.save {model: sd}, no-write writer", _under_model(_fast_plan_save))}),
    ScanOps("mmapckpt", True, {"save": ("dcp.save, MmapWriter", _mmap_save),
                               "warm": ("dcp.load, MmapReader", _mmap_load),
                               "plan": ("dcp.load, no-copy reader", _mmap_plan),
                               "plan_save": ("dcp.save, no-write writer", _mmap_plan_save)}),
    ScanOps("dcp", True, {"save": ("dcp.save, FileSystemWriter", _dcp_save),
                          "warm": ("dcp.load, FileSystemReader", _dcp_load)}),
)
#: The methods of ``mmapckpt bench --scan tensors``, in the order it reports them.
SCAN_METHODS = tuple(o.key for o in _SCAN_OPS)


def scan_ops(key: str) -> ScanOps:
    for o in _SCAN_OPS:
        if o.key == key:
            return o
    raise KeyError(f"method {key!r} is not scanned; scanned: {list(SCAN_METHODS)}")
