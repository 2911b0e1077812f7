"""The ranks of a managed save or load agreeing on one outcome, decided by the coordinator.

A save's preparation (clearing what a killed save of the same step left) and a load's choice of
step run on the coordinator only, the rank 0 of the process group, as DCP's coordinator; the
other ranks must then raise the same error or use the same step, or they would wait in DCP's
collectives for ever. Without an initialised process group there is one rank.
"""

from __future__ import annotations

from collections.abc import Callable
import pickle
from typing import Any, TypeVar

import torch.distributed as dist

from ..errors import CheckpointError

__all__ = ["distributed", "is_coordinator", "decided"]

T = TypeVar("T")


def distributed() -> bool:
    """Whether a default process group is initialised (DCP's ``no_dist`` is its negation)."""
    return dist.is_available() and dist.is_initialized()


def is_coordinator(group: Any = None) -> bool:
    """Whether this process is the coordinator of ``group`` (its rank 0), or the only process."""
    return not distributed() or dist.get_rank(group) == 0


def decided(decide: Callable[[], T], group: Any = None) -> T:
    """``decide()`` on the coordinator; its result, or the exception it raised, on every rank of ``group``."""
    outcome: list[Any] = [None]
    if is_coordinator(group):
        try:
            outcome[0] = ("ok", decide())
        except Exception as e:  # the other ranks raise it too
            outcome[0] = ("error", e if _picklable(e) else CheckpointError(f"{type(e).__name__}: {e}"))
    if distributed() and dist.get_world_size(group) > 1:
        src = 0 if group is None else dist.get_global_rank(group, 0)
        dist.broadcast_object_list(outcome, src=src, group=group)
    kind, value = outcome[0]
    if kind == "error":
        raise value
    return value  # type: ignore[no-any-return]


def _picklable(e: BaseException) -> bool:
    try:
        pickle.loads(pickle.dumps(e))
    except Exception:
        return False
    return True
