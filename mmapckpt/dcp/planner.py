"""Load planners for ``dcp.load`` with :class:`~mmapckpt.MmapReader`.

``SafeLoadPlanner`` is DCP's ``DefaultLoadPlanner`` (through :class:`FastLoadPlanner`,
whose plans equal the default planner's and cost several times less per tensor) except
that non-tensor entries are unpickled with ``torch.load(weights_only=True)`` unless the caller
allows full unpickling (the default planner runs ``weights_only=False``, so a
crafted checkpoint can run code on load).

``ZeroCopyLoadPlanner`` also lets ``MmapReader`` hand it the stored chunk as a
view over the shard mapping (the reader calls ``planner.accept_view(read_item,
view)`` before copying). It keeps the view, replacing the state dict entry,
when the entry is a plain CPU tensor (or ``nn.Parameter``) of the stored dtype and
shape and the stored chunk is the whole tensor. Otherwise it declines and the
reader copies as usual: DTensors and other subclasses, accelerator targets,
dtype or shape differences, tensors stored as several chunks, stock DCP files.
"""

from __future__ import annotations

import io
from typing import Any

import torch
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.planner import ReadItem

from ..errors import CheckpointError
from .fast_planner import FastLoadPlanner

__all__ = ["SafeLoadPlanner", "ZeroCopyLoadPlanner"]


class SafeLoadPlanner(FastLoadPlanner):
    """``DefaultLoadPlanner`` that unpickles non-tensor entries only with ``weights_only=True``.

    It plans as :class:`FastLoadPlanner` (the same plans as DCP's default planner, built
    faster); with ``MmapReader`` it and ``FastLoadPlanner`` are the recommended planners.

    Args:
        allow_unpickle: unpickle non-tensor entries fully (``weights_only=False``), as
            DCP's default planner does; only for checkpoints you trust.
        **kwargs: passed to ``DefaultLoadPlanner`` (``flatten_state_dict``, ``allow_partial_load``...).

    Raises (inside ``dcp.load``, wrapped in ``CheckpointException``):
        CheckpointError: a non-tensor entry needs more than ``weights_only`` unpickling.
    """

    def __init__(self, *, allow_unpickle: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.allow_unpickle = allow_unpickle

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        if self.allow_unpickle:
            super().load_bytes(read_item, value)
            return
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except Exception as e:
            raise CheckpointError(
                f"non-tensor entry cannot be loaded with weights_only=True ({type(e).__name__}); "
                "pass allow_unpickle=True to the planner if you trust this checkpoint", entry=fqn) from None
        self._replace(fqn, obj)

    def _replace(self, fqn: str, value: Any) -> None:
        """Put ``value`` in place of the state dict entry ``fqn`` (as DCP's load_bytes does)."""
        self.state_dict[fqn] = value
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], value)
        elif fqn in self.original_state_dict:
            self.original_state_dict[fqn] = value


class ZeroCopyLoadPlanner(SafeLoadPlanner):
    """Leaves CPU state dict entries as copy-on-write views over the checkpoint's mapping.

    Use with ``MmapReader``; entries it takes as views are *replaced* in the state
    dict passed to ``dcp.load`` (the tensors that were there are not written), so
    load a model from the result with ``model.load_state_dict(sd, assign=True)``.

    Example:
        >>> sd = {k: torch.empty_like(v) for k, v in model.state_dict().items()}
        >>> dcp.load(sd, storage_reader=MmapReader(path), planner=ZeroCopyLoadPlanner())
        >>> model.load_state_dict(sd, assign=True)
    """

    def accept_view(self, read_item: ReadItem, view: torch.Tensor) -> bool:
        """Keep ``view`` (the whole stored chunk) as the entry if it matches exactly; else return False."""
        target = self.lookup_tensor(read_item.dest_index)
        is_param = isinstance(target, torch.nn.Parameter)
        if not (type(target) is torch.Tensor or (is_param and type(target.data) is torch.Tensor)):
            return False
        whole = tuple(target.shape)
        if (target.device.type != "cpu" or target.dtype != view.dtype or tuple(view.shape) != whole
                or any(read_item.storage_offsets) or any(read_item.dest_offsets)
                or tuple(read_item.lengths) != whole):
            return False
        value = torch.nn.Parameter(view, requires_grad=target.requires_grad) if is_param else (
            view.requires_grad_() if target.requires_grad else view)
        self._replace(read_item.dest_index.fqn, value)
        return True
