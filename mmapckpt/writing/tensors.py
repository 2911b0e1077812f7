"""A tensor's bytes as a shard stores them: C order, logical values, checked against the planned entry."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from ..format import layout as fmt
from ..io.d2h import stage_to_host

__all__ = ["tensor_bytes", "planned_bytes", "entry_bytes"]

#: dtype -> the dtype numpy views its tensors' bytes as: itself (None), or an integer of its width for
#: the dtypes numpy lacks (a CPU tensor's bytes without torch's view chain)
_NUMPY_VIEW: dict[torch.dtype, torch.dtype | None] = {
    **dict.fromkeys((torch.float64, torch.float32, torch.float16, torch.int64, torch.int32, torch.int16, torch.int8,
                     torch.uint8, torch.bool, torch.complex64, torch.complex128)),
    torch.bfloat16: torch.int16, torch.uint16: torch.int16, torch.uint32: torch.int32, torch.uint64: torch.int64,
    **dict.fromkeys((getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
                     if hasattr(torch, n)), torch.uint8),
}


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The tensor's own bytes in C order, from its memory where it is contiguous."""
    view_as = _NUMPY_VIEW.get(t.dtype, t)  # t: not viewable
    if (view_as is not t and t.is_cpu and t.is_contiguous() and t.numel() > 1 and not t.requires_grad
            and not t.is_conj() and not t.is_neg()):
        # the common case, at a third of the steps below
        return memoryview((t if view_as is None else t.view(view_as)).numpy()).cast("B")
    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    t = t.resolve_conj().resolve_neg().contiguous().reshape(-1)
    if t.numel() == 1 and t.stride(0) != 1:  # one element counts as contiguous whatever its stride
        t = t.clone(memory_format=torch.contiguous_format)
    return memoryview(t.view(torch.uint8).numpy())


def planned_bytes(e: Any, t: torch.Tensor) -> Any:
    """The bytes of ``t``, resolved for entry ``e`` (its ``fqn``, ``shape``, ``dtype`` name and ``length``),
    after checking it is the tensor the shard was laid out for (ValueError otherwise)."""
    if t.shape != e.shape or fmt.dtype_name(t.dtype) != e.dtype:
        raise ValueError(f"planner resolved {e.fqn!r} to {tuple(t.shape)} {t.dtype}, "
                         f"but the plan said {e.shape} {e.dtype}")
    return tensor_bytes(t) if e.length else b""


def entry_bytes(entries: Sequence[Any], order: Sequence[int], resolve: Callable[[Any], Any],
                at: Any) -> Iterator[tuple[int, Any]]:
    """``(i, the bytes of entry i)`` for each index of ``order``: a bytes entry's data as it is, a tensor
    resolved and staged to the host (io/d2h.py, ahead of its turn) and checked (:func:`planned_bytes`).
    ``at.index`` follows the entry; no tensor is held while the next one is resolved."""
    staged = stage_to_host([entries[i].data for i in order if entries[i].kind != fmt.KIND_BYTES], resolve)
    for i in order:
        at.index = i
        e = entries[i]
        if e.kind == fmt.KIND_BYTES:
            yield i, e.data
            continue
        key, t = next(staged)
        assert key is e.data  # stage_to_host yields in order (an invariant of ours, not file content)
        data, t = planned_bytes(e, t), None
        yield i, data
        data = None  # not held by this frame while the next one is resolved
    at.index = None
