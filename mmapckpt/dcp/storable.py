"""Which tensors a checkpoint can hold: dense tensors with data of their own, in a dtype of the format.

A meta tensor (no data), a sparse, mkldnn or nested tensor (no one dense run of bytes), a
quantized tensor or another dtype outside the format's table, an uninitialized parameter of a
lazy module, and a tensor subclass with its own ``__torch_dispatch__`` (a wrapper whose bytes
are not in its own storage) are refused before anything is written, with a
CheckpointWriteError that names the entry and says what to save instead.
"""

from __future__ import annotations

import torch

from ..errors import CheckpointWriteError
from ..format.dtypes import DTYPES

__all__ = ["CHECKED_ATTR", "unstorable", "check_storable"]

#: A SavePlanner attribute: True where every tensor its ``resolve_data`` returns was checked by
#: :func:`check_storable` already (``mmapckpt.save`` checks all of them before it writes), so
#: that the shard writer does not check each one again.
CHECKED_ATTR = "mmapckpt_storable_checked"

_PLAIN = (torch.Tensor, torch.nn.Parameter)
_FORMAT_DTYPES = frozenset(dt for dt, _ in DTYPES.values())
_NO_DISPATCH = torch._C._disabled_torch_dispatch_impl


def unstorable(t: torch.Tensor) -> str | None:
    """Why ``t`` cannot be stored (what it is and what to save instead), or None where it can."""
    if type(t) not in _PLAIN:
        if isinstance(t, torch.nn.parameter.UninitializedTensorMixin):
            return ("is an uninitialized parameter or buffer of a lazy module: it has no shape or data yet; run a "
                    "forward pass (or initialise the module) before saving")
        if t.is_nested:
            return "is a nested tensor: save its components (t.unbind()) as separate entries"
        if getattr(type(t), "__torch_dispatch__", _NO_DISPATCH) is not _NO_DISPATCH:
            return (f"is a {type(t).__name__}, a tensor subclass with its own __torch_dispatch__, whose bytes are "
                    "not in a storage of its own: save its inner tensors, or a plain tensor made from it")
    if t.is_meta:
        return ("is a meta tensor: it has a shape and a dtype but no data; materialize it first (e.g. "
                "module.to_empty(device='cpu'), then initialise or load its values), or leave it out")
    if t.is_nested:
        return "is a nested tensor: save its components (t.unbind()) as separate entries"
    if t.layout is not torch.strided:
        return (f"has layout {t.layout}: a checkpoint holds dense tensors; save t.to_dense(), or its indices and "
                "values as separate entries")
    if t.dtype not in _FORMAT_DTYPES:
        hint = ("; save t.int_repr() with t.q_scale() and t.q_zero_point(), or t.dequantize()" if t.is_quantized
                else "")
        return f"has dtype {t.dtype}, which the mmapckpt format cannot store (docs/format.md, section 2.4){hint}"
    return None


def check_storable(fqn: str, t: torch.Tensor, path: str | None) -> None:
    """Raise CheckpointWriteError naming ``fqn`` (in the checkpoint at ``path``) if ``t`` cannot be stored."""
    why = unstorable(t)
    if why is not None:
        raise CheckpointWriteError(f"cannot save this tensor: it {why}", path=path, entry=fqn)
