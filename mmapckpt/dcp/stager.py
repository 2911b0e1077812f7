"""PinnedStager: the host copy behind ``dcp.async_save``, in host buffers reused from save to save.

``dcp.async_save`` blocks the training loop while its stager makes a "training-safe" CPU copy
of the state dict, then writes that copy in a background thread. Without a stager, torch 2.13
makes a ``DefaultStager`` with every option off: each save copies every tensor synchronously
into freshly allocated pageable memory. This stager copies accelerator tensors with
non-blocking copies into page-locked buffers, one side stream per device and one wait at the
end, and keeps the buffers for the next save of the same tensors.
"""

from __future__ import annotations

import copy
import time
from typing import Any

import torch
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.tensor import DTensor

from ..io.d2h import DeviceCopies, HostBuffer

__all__ = ["PinnedStager"]

#: values DCP's own stager hands on as they are (its deepcopy treats them as atomic)
_ATOMIC = (type(None), int, float, bool, complex, bytes, str, range, type)
#: tensor types staged as plain tensors (a Parameter's bytes are its data)
_PLAIN = (torch.Tensor, torch.nn.Parameter, torch.nn.Buffer)

Path = tuple[Any, ...]

#: How long ``stage`` waits for the previous staged dict to be let go before it stages into fresh
#: buffers. ``dcp.async_save``'s future completes a moment before its thread drops the staged dict
#: (the thread pool's work item holds it until the next loop turn): a save that has finished, even
#: one whose ``result()`` the caller has seen, can still look in use for some microseconds.
DEFAULT_GRACE_S = 0.005
_POLL_S = 0.0002


class _HostCopy:
    """One host copy of a state dict: a buffer per tensor position."""

    __slots__ = ("buffers",)

    def __init__(self) -> None:
        self.buffers: dict[Path, HostBuffer] = {}  # position in the state dict -> its buffer

    def in_use(self, grace_s: float = 0.0) -> bool:
        """Whether any tensor handed out over these buffers is still referenced after up to ``grace_s`` s."""
        deadline = time.monotonic() + grace_s
        while any(b.in_use() for b in self.buffers.values()):
            if time.monotonic() >= deadline:
                return True
            time.sleep(_POLL_S)  # lets the thread that finished the save drop its references
        return False


class _Staging:
    """One ``stage`` call: walks the state dict, copies tensors into the free buffers of ``reuse`` or new ones."""

    def __init__(self, reuse: _HostCopy, copies: DeviceCopies) -> None:
        self.reuse, self.copies = reuse, copies
        self.result = _HostCopy()
        self.memo: dict[int, Any] = {}  # id(source) -> staged: a tensor held twice is staged once
        self.allocated = 0

    def value(self, x: Any, path: Path) -> Any:
        if isinstance(x, torch.Tensor):
            staged = self.memo.get(id(x))
            if staged is None:
                staged = self.memo[id(x)] = self._tensor_like(x, path)
            return staged
        if type(x) in _ATOMIC:
            return x
        if isinstance(x, dict):
            y = {} if type(x) is dict else copy.copy(x)  # an OrderedDict stays one, a defaultdict keeps its factory
            for k, v in x.items():
                y[k] = self.value(v, path + (k,))
            return y
        if isinstance(x, list):
            y = copy.copy(x)
            for i, v in enumerate(x):
                y[i] = self.value(v, path + (i,))
            return y
        if isinstance(x, tuple):
            items = [self.value(v, path + (i,)) for i, v in enumerate(x)]
            return type(x)(*items) if hasattr(x, "_fields") else type(x)(items)  # a namedtuple too
        return copy.deepcopy(x)  # as DCP's stager does for anything else (a BytesIO, a dataclass, ...)

    def _tensor_like(self, x: torch.Tensor, path: Path) -> Any:
        if isinstance(x, DTensor):
            # a DTensor with a CPU local tensor and the same spec, as DCP's stager makes
            return DTensor(self._tensor(x._local_tensor, path), x._spec, requires_grad=False)
        if isinstance(x, ShardedTensor):
            return self._sharded(x, path)
        if type(x) in _PLAIN:
            return self._tensor(x, path)
        # another tensor subclass: a plain copy keeps its type; its buffers are not reused
        return x.detach().to("cpu", copy=True)

    def _tensor(self, x: torch.Tensor, path: Path) -> torch.Tensor:
        pinned_for = x.device if x.device.type != "cpu" else None
        buf = self.reuse.buffers.get(path)
        if buf is None or not buf.fits(x, pinned_for) or buf.in_use():  # never under a tensor still alive
            buf = HostBuffer(x.shape, x.dtype, pinned_for)
            self.allocated += 1
        self.result.buffers[path] = buf
        if pinned_for is None:
            buf.target.copy_(x.detach())
        else:
            self.copies.copy(buf.target, x.detach())
        return buf.hand_out()

    def _sharded(self, x: ShardedTensor, path: Path) -> ShardedTensor:
        shards = []
        for i, shard in enumerate(x.local_shards()):
            meta = copy.deepcopy(shard.metadata)
            meta.placement._device = torch.device("cpu")  # as ShardedTensor.cpu() does
            shards.append(Shard(self._tensor(shard.tensor, path + (i,)), meta))
        st_meta = copy.deepcopy(x.metadata())
        for meta in st_meta.shards_metadata:
            meta.placement._device = torch.device("cpu")
        return ShardedTensor._init_from_local_shards_and_global_metadata(
            shards, sharded_tensor_metadata=st_meta, process_group=x._process_group, init_rrefs=x._init_rrefs)


class PinnedStager(AsyncStager):
    """A ``dcp.async_save`` stager whose host copy is made in reused, page-locked buffers.

    Create one per training job and pass it to every save; ``close()`` it after the last::

        stager = mmapckpt.PinnedStager()
        for step in range(steps):
            train_step()
            if step % 1000 == 0:
                if pending is not None:
                    pending.result()          # the previous save is durable
                pending = dcp.async_save(model.state_dict(), async_stager=stager,
                                         storage_writer=mmapckpt.MmapWriter(f"ckpt/{step}"))
        pending.result()
        stager.close()

    ``stage`` (called by ``dcp.async_save``) returns a CPU copy of the state dict with the same
    structure once every byte is on the host, which is all the time the training loop is
    blocked. Tensors on an accelerator are copied ``non_blocking`` into page-locked host memory
    on one side stream per device, which first waits for the caller's current stream, with one
    synchronize at the end; CPU tensors are copied too (training goes on changing them). A
    DTensor comes back as a DTensor with the same spec over a CPU local tensor, a ShardedTensor
    as one with CPU shards, as DCP's own stager makes them; dicts, lists and tuples are rebuilt,
    ints, floats, strings and None handed on, other values deep-copied.

    Buffers: allocated on the first ``stage`` and reused by the next ones for the tensors at the
    same position in the state dict with the same shape and dtype (a changed tensor gets a new
    buffer, a position gone drops its buffer). Only buffers for accelerator tensors are
    page-locked, by registering exactly their pages with the driver (``cudaHostRegister``;
    ``pin_memory`` on other accelerators); a CPU-only state dict is staged into plain memory, as
    page-locking it would only cost time. Between saves the stager holds one host copy of the
    state dict, as any asynchronous save must, and nothing more (a page-locked buffer is padded
    to whole 4 KiB pages: at most 8 KiB more per accelerator tensor).

    Safety: the buffers of a staged state dict are never overwritten while any tensor handed out
    in it, or any view or slice of one, is still referenced (each is watched through a storage
    of its own over the buffer); ``dcp.async_save`` holds the staged dict until its write has
    finished. If the
    previous save is still writing when ``stage`` is called, this one is staged into fresh
    buffers instead (after waiting up to ``grace_s``, 5 ms by default, for the save's thread
    to let go of it; each buffer is judged on its own, so one a caller kept a slice of is the
    only one replaced): it costs an allocation (and page-locking) of the whole state dict, and,
    until the older save finishes, two host copies. Wait for the previous save's future before
    the next ``async_save`` to avoid it. ``fresh_copies`` counts how often that happened.

    Args:
        grace_s: how long ``stage`` waits for the previous staged dict to be let go (a finished
            save's thread drops it a moment after its future completes) before staging into
            fresh buffers instead (see Safety).

    Attributes:
        allocations: host buffers allocated so far (equal to the number of tensors after the
            first save, unchanged by later saves of the same tensors).
        fresh_copies: times a ``stage`` found the previous staged dict still in use.
    """

    #: stage() returns the staged dict itself: async_save has nothing to wait for afterwards
    _synchronize_after_execute: bool = False

    def __init__(self, *, grace_s: float = DEFAULT_GRACE_S) -> None:
        """Make a stager; its buffers are allocated by the first ``stage`` (see the class for ``grace_s``)."""
        self._grace_s = grace_s
        self._copy: _HostCopy | None = _HostCopy()
        self._copies = DeviceCopies()
        self.allocations = 0
        self.fresh_copies = 0

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Copy ``state_dict`` to the host; returns once every byte is there.

        Args:
            state_dict: the state dict ``dcp.async_save`` was given (nested dicts, lists and
                tuples of tensors, DTensors, ShardedTensors and other values).

        Returns:
            The staged copy, with the same structure, every tensor on the CPU.

        Raises:
            RuntimeError: the stager was closed.
        """
        if self._copy is None:
            raise RuntimeError("PinnedStager.stage: this stager was closed (its host buffers are freed); "
                               "create a new PinnedStager for further saves")
        if self._copy.in_use(self._grace_s):  # the previous save still holds its staged dict: leave it be
            self.fresh_copies += 1
        staging = _Staging(self._copy, self._copies)
        with torch.no_grad():
            try:
                staged = staging.value(state_dict, ())
            finally:
                self._copies.synchronize()  # also on a failure: no copy may still run into the buffers
        self._copy = staging.result
        self.allocations += staging.allocated
        return staged

    def synchronize_staging(self) -> None:
        """Nothing to wait for: ``stage`` returns only once the copy is complete."""

    def close(self) -> None:
        """Free the host buffers; a later ``stage`` raises. Buffers a save still holds are freed when it ends."""
        if self._copy is not None:
            self._copies.close()
        self._copy = None

    @property
    def closed(self) -> bool:
        """Whether ``close()`` was called."""
        return self._copy is None
