"""``mmapckpt.load_into``: fill existing tensors from a checkpoint, in place, in one process.

The same bytes ``dcp.load`` would put into the same targets, without DCP's planning
(which costs tens of microseconds a tensor): for inference servers and single-process
jobs with preallocated (or pinned, or model-owned) tensors. Tensors stored whole in an
mmapckpt shard (or aligned in a safetensors file) are read with ``preadv`` straight into
contiguous CPU targets (the direct read of ``reading/moves.py``); everything else is
copied from the mapped views, or assembled from its chunks (resharded checkpoints, stock
DCP items, torch.save tensors).
"""

from __future__ import annotations

import os
import sys
from typing import Any, Mapping

import torch

from .errors import SizeMismatchError
from .format.entries import EntryInfo, paused_gc
from .reading.fill import fill_targets
from .io.staging_options import DEFAULT_STAGING_BUFFERS, DEFAULT_STAGING_BYTES, needs_staging, stage_cpu_targets
from .lazy import LazyCheckpoint

__all__ = ["load_into", "fill_from"]


def load_into(state_dict: Mapping[str, Any], path: str | os.PathLike[str], *, strict: bool = True,
              allow_cast: bool = False, staging_bytes: int = DEFAULT_STAGING_BYTES,
              staging_buffers: int = DEFAULT_STAGING_BUFFERS,
              storage_options: Mapping[str, Any] | None = None, strip_prefix: str | None = None) -> list[str]:
    """Copy the checkpoint's tensors into the tensors of ``state_dict``, in place.

    Every tensor value of ``state_dict`` receives the full (unsharded) tensor of the same
    name, cast to its dtype as ``Tensor.copy_`` does; other values are left alone. A cast
    that would change values beyond rounding (floating point or complex into integers,
    complex into real, a value outside the target dtype's range: int64 1000 into int8,
    float32 ``1e30`` into float16) is refused, unless ``allow_cast`` (docs/lazy.md, "Casts"): a
    refusal by kind before any target is written; by range as the values are copied, targets
    whose dtype may not hold every stored value being filled first (each piece checked before it
    is written), so that a refusal leaves the others unwritten. Use
    ``dcp.load`` for DTensors and other sharded targets, and ``load`` with
    ``model.load_state_dict(sd, assign=True)`` for a model on the meta device.

    Args:
        state_dict: ``{fqn: tensor}`` (a ``model.state_dict()`` works), CPU or accelerator tensors.
        path: a checkpoint directory or file in any format :func:`mmapckpt.open` takes (mmapckpt,
            stock DCP, safetensors file or Hugging Face directory, torch.save file).
        strict: raise KeyError if a tensor of ``state_dict`` is not in the checkpoint;
            with False, such tensors are left unchanged and their names returned.
        allow_cast: also copy into targets whose dtype changes the stored values beyond rounding
            (floating point or complex into integers or bool, complex into real, values outside the
            target dtype's range, which then wrap or become inf as ``Tensor.copy_`` makes them);
            refused by default. The range is checked only for pairs of dtypes where a value can fall
            outside (int64 into int32, float32 into float16 or bfloat16), as the values are copied
            into CPU targets (one read of the stored bytes), before the fill of accelerator ones.
        staging_bytes: the size of each buffer of the pinned staging ring for accelerator
            targets (allocated for this call only when a target is on one).
        staging_buffers: the number of buffers in that ring.
        storage_options: settings of an object store's client (see :func:`mmapckpt.open`).
        strip_prefix: remove this prefix (e.g. ``"model."``) from the checkpoint's names that
            start with it before matching them with ``state_dict``'s (see :func:`mmapckpt.open`).

    Returns:
        The names of ``state_dict``'s tensors that the checkpoint does not hold (empty when strict).

    Raises:
        KeyError: ``strict`` and names missing from the checkpoint.
        TypeError: a target is a DTensor.
        CastError: a target's dtype would change the stored values (see ``allow_cast``; also a TypeError).
        ValueError: a target is on the meta device (it has no memory to fill).
        CheckpointError: a damaged checkpoint, a name holding a non-tensor value, or a
            stored shape other than the target's (SizeMismatchError).

    Example:
        >>> model = MyModel()
        >>> mmapckpt.load_into(model.state_dict(), "/tmp/ckpt")
    """
    targets = {n: t for n, t in state_dict.items() if isinstance(t, torch.Tensor)}
    _refuse_dtensors(targets)
    meta = [n for n, t in targets.items() if t.is_meta]
    if meta:
        raise ValueError(f"{meta[0]!r} (and {len(meta) - 1} more) is on the meta device: it has no memory to load "
                         "into. Use mmapckpt.load_model(model, path), which replaces meta tensors (or "
                         "model.load_state_dict(mmapckpt.load(path), assign=True)), instead")
    with LazyCheckpoint(path, storage_options=storage_options, strip_prefix=strip_prefix) as ckpt:
        return fill_from(ckpt, targets, strict=strict, allow_cast=allow_cast, staging_bytes=staging_bytes,
                         staging_buffers=staging_buffers)


def fill_from(ckpt: LazyCheckpoint, targets: Mapping[str, torch.Tensor], *, strict: bool = True,
              allow_cast: bool = False, staging_bytes: int = DEFAULT_STAGING_BYTES,
              staging_buffers: int = DEFAULT_STAGING_BUFFERS, values_first: bool = False) -> list[str]:
    """:func:`load_into`'s work on the open ``ckpt`` (its names: ``strip_prefix`` applied when it was opened):
    every target's name, shape and dtype checked before any is written, then filled (the values of casts that may
    not hold them checked as they are copied: :func:`_fill_checked`; with ``values_first``, every such value checked
    before any target is written, which reads those tensors twice). Returns the missing names.
    ``load_model`` calls it with the checkpoint it has already opened, ``values_first``: a refusal leaves its
    model as it was."""
    with paused_gc(), torch.no_grad():
        missing = [n for n in targets if n not in ckpt]
        if missing and strict:
            raise KeyError(f"not in the checkpoint at {ckpt.path}: {sorted(missing)[:20]}")
        skip = set(missing)
        info_of = ckpt.tensor_info
        plan = [(n, t, info_of(n)) for n, t in targets.items() if n not in skip] if skip else \
            [(n, t, info_of(n)) for n, t in targets.items()]
        cast = False
        for name, t, info in plan:
            if t.shape != info.shape:  # torch.Size is a tuple: equal to the stored shape's tuple
                raise SizeMismatchError(f"stored tensor is {list(info.shape or ())} but the target is {list(t.shape)}",
                                        path=ckpt.path, entry=info.name)
            if info.dtype != t.dtype:
                cast = True
                _casts().check_cast(None, info.dtype, t.dtype, allow_cast=allow_cast, path=ckpt.path, entry=info.name)
        # the values, where the target's dtype may not hold them all (none of it with allow_cast)
        checked = [] if allow_cast or not cast else [p for p in plan if p[2].dtype != p[1].dtype
                                                     and _casts().range_can_shrink(p[2].dtype, p[1].dtype)]
        if checked and values_first:
            from .reading.regions import read_tensor

            for name, t, info in checked:
                _casts().check_cast(read_tensor(ckpt.backend, info), info.dtype, t.dtype, allow_cast=False,
                                    path=ckpt.path, entry=info.name)
        elif checked:
            plan = _fill_checked(ckpt, plan, checked)
        # needs_staging per target, with the tests' switch asked once
        cpu = [] if stage_cpu_targets() else [p for p in plan if p[1].is_cpu]
        fill_targets(ckpt.backend, cpu)
        if len(cpu) < len(plan):
            _fill_devices(ckpt, [p for p in plan if needs_staging(p[1])], staging_bytes, staging_buffers)
    return missing


def _fill_checked(ckpt: LazyCheckpoint, plan: list[tuple[str, torch.Tensor, EntryInfo]],
                  checked: list[tuple[str, torch.Tensor, EntryInfo]]) -> list[tuple[str, torch.Tensor, EntryInfo]]:
    """Fill the CPU targets of ``checked`` (whose dtype may not hold every stored value) first, each piece's values
    checked as it is copied (format/casts.py, one read of the stored bytes); check the accelerator ones' values
    (read once more: they are staged later). Return the rest of ``plan``, to fill: a refusal leaves it unwritten."""
    from .format.casts import check_cast, copy_in_range
    from .reading.regions import read_tensor

    done: set[str] = set()
    for name, t, info in checked:
        if needs_staging(t):
            check_cast(read_tensor(ckpt.backend, info), info.dtype, t.dtype, allow_cast=False, path=ckpt.path,
                       entry=info.name)
    for name, t, info in checked:
        if not needs_staging(t):
            copy_in_range(read_tensor(ckpt.backend, info), t.detach(), path=ckpt.path, entry=info.name)
            done.add(name)
    ckpt.backend.check_unchanged(c for _, _, info in checked for c in info.chunks)
    return [p for p in plan if p[0] not in done]


def _fill_devices(ckpt: LazyCheckpoint, plan: list[tuple[str, torch.Tensor, EntryInfo]], staging_bytes: int,
                  staging_buffers: int) -> None:
    """Accelerator targets: every chunk read into the pinned staging ring and copied into its region."""
    from .io.staging import StagingPool  # the pipeline, imported by loads that have accelerator targets only
    from .reading.stager import chunk_stager

    by_device: dict[torch.device, list[tuple[str, torch.Tensor, EntryInfo]]] = {}
    for p in plan:
        by_device.setdefault(p[1].device, []).append(p)
    for device, items in by_device.items():
        pool = StagingPool(device, staging_bytes=staging_bytes, staging_buffers=staging_buffers)
        try:
            with pool, chunk_stager(ckpt.backend, [info for _, _, info in items]) as stage_chunk:
                for name, t, info in items:
                    for c in info.chunks:
                        region = tuple(slice(o, o + s) for o, s in zip(c.offsets, c.sizes))
                        stage_chunk(pool, info, c, t.detach()[region])
        finally:
            pool.close()


def _casts() -> Any:
    """format/casts.py, imported by the loads whose targets' dtypes differ from the stored ones only."""
    from .format import casts

    return casts


def _refuse_dtensors(targets: dict[str, torch.Tensor]) -> None:
    # A DTensor exists only once its module is imported: where it is not, no target is one, and the
    # check imports nothing (importing torch.distributed.tensor costs about half a second).
    api = sys.modules.get("torch.distributed.tensor")
    DTensor = getattr(api, "DTensor", None)
    if DTensor is None:
        return
    for n, t in targets.items():
        if isinstance(t, DTensor):
            raise TypeError(f"{n!r} is a DTensor: load sharded targets with dcp.load(..., "
                            "storage_reader=mmapckpt.MmapReader(path))")
