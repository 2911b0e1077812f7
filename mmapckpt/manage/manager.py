"""``CheckpointManager``: the checkpoints of a training run as numbered steps under one root.

Each step is an ordinary mmapckpt checkpoint in ``ROOT/step-{N}/`` (``root.py``), saved with
``dcp.save``/``dcp.async_save`` through ``MmapWriter(overwrite=False)`` and loaded with
``dcp.load`` through ``MmapReader``. The manager adds what every training loop writes by hand:
which steps are committed, which is the latest, retention after each save (``retention.py``),
loads that retention never removes a step from under (``leases.py``), and saves that never
overwrite, so none waits for a dead job's lock. docs/manager.md says it in full.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
from collections.abc import Mapping
from importlib.util import find_spec
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

from ..dcp.fast_planner import FastSavePlanner
from ..dcp.reader import MmapReader
from ..dcp.reuse import HeaderCache
from ..dcp.unwrap import checkpoint_error
from ..dcp.writer import MmapWriter
from ..errors import CheckpointNotFoundError, IncompleteCheckpointError
from .collective import decided, distributed, is_coordinator
from .leases import DEFAULT_LEASE, Lease, lease_committed, recommitted
from .retention import Known, apply_retention, prepare_step
from .root import Root, step_dir

__all__ = ["CheckpointManager"]

_log = logging.getLogger("mmapckpt")


class CheckpointManager:
    """The checkpoints of a training run: numbered steps under one root, with retention, leases and resume.

    Args:
        root: a local directory or an object-store prefix (``s3://``, ``az://``, ``gs://``) holding one run's steps
            (``ROOT/step-{N}/``);
            created at the first save.
        keep_last: after each committed save, keep the newest ``keep_last`` steps (None: keep every step).
        keep_every: also keep every step that is a multiple of ``keep_every`` (with ``keep_last``).
        storage_options: for an object-store root: credentials, endpoint, part sizes (docs/object-storage.md).
        lease_seconds: how long a load's lease lasts without renewal (renewed every quarter of it).

    Raises:
        CheckpointError: ``root`` cannot be a root: a file, a checkpoint, a foreign marker, a URL of no medium.

    Example:
        >>> manager = CheckpointManager("run", keep_last=3)  # doctest: +SKIP
        >>> start = manager.load(state_dict) + 1 if manager.latest() is not None else 0  # doctest: +SKIP
        >>> manager.save(state_dict, step)  # doctest: +SKIP
    """

    def __init__(self, root: str | os.PathLike[str], *, keep_last: int | None = None, keep_every: int | None = None,
                 storage_options: Mapping[str, Any] | None = None, lease_seconds: float = DEFAULT_LEASE) -> None:
        for name, value in (("keep_last", keep_last), ("keep_every", keep_every)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{name} must be a positive int or None, not {value!r}")
        if not lease_seconds > 0:
            raise ValueError(f"lease_seconds must be positive, not {lease_seconds!r}")
        self.keep_last, self.keep_every, self.lease_seconds = keep_last, keep_every, float(lease_seconds)
        self._root = Root(root, storage_options)
        self._root.check()
        self._pending: concurrent.futures.Future[Any] | None = None
        self._marked = False
        self._known: Known = {}  # what retention read of each committed step's .metadata (retention.py)
        self._headers = HeaderCache()  # the reused shard headers, read once across saves (dcp/reuse.py)

    def __repr__(self) -> str:
        return f"CheckpointManager({self._root.location!r}, keep_last={self.keep_last}, keep_every={self.keep_every})"

    # ------------------------------------------------------------------ what is there
    @property
    def root(self) -> str:
        """The root, as given (a path or a URL)."""
        return self._root.location

    def path(self, step: int) -> str:
        """Where step ``step`` is (``ROOT/step-{step}``): a checkpoint every reader of mmapckpt reads."""
        return self._root.join(step_dir(_checked(step)))

    def steps(self) -> list[int]:
        """The committed steps, ascending."""
        return sorted(s for s, committed in self._root.step_dirs().items() if committed)

    def latest(self) -> int | None:
        """The newest committed step, or None before the first."""
        steps = self.steps()
        return steps[-1] if steps else None

    # ------------------------------------------------------------------ saving
    def save(self, state_dict: dict[str, Any], step: int, *, async_: bool = False, process_group: Any = None,
             stager: Any = None) -> Any:
        """Save ``state_dict`` as step ``step`` (every rank calls it, as ``dcp.save``), then apply retention.

        The step is visible (in :meth:`steps`) once its ``.metadata`` is committed, never before; a step already
        committed is never overwritten. Leftovers of a killed save of the same step are removed first.

        Args:
            state_dict: what ``dcp.save`` takes.
            step: the step number, an int >= 0.
            async_: save through ``dcp.async_save``: returns once the state dict is staged, with its future
                (an earlier asynchronous save is waited for first).
            process_group: the group of the ranks saving (``dcp.save``'s); the default group where None.
            stager: with ``async_``, the ``AsyncStager`` (a ``mmapckpt.PinnedStager`` made once for the job).

        Returns:
            ``dcp.save``'s Metadata; with ``async_``, a future (or ``AsyncSaveResponse``) done once the step is
            committed and retention has run.

        Raises:
            CheckpointExistsError: step ``step`` is already committed.
            CheckpointError: the save failed (DCP wraps a rank's error in its CheckpointException).
        """
        step = _checked(step)
        if stager is not None and not async_:
            raise TypeError("stager= is for asynchronous saves: pass async_=True with it")
        self.wait()
        prior = decided(lambda: self._prepare(step), process_group)  # the newest committed step, [] before the first
        # chunks equal to the newest step's are stored once (dcp/reuse.py; hashing needs blake3: without it
        # every step is written whole, as docs/manager.md says)
        reuse = [self.path(s) for s in prior] if find_spec("blake3") is not None else []
        writer = MmapWriter(self.path(step), overwrite=False, storage_options=self._root.options, reuse=reuse,
                            _reuse_cache=self._headers)
        # DCP's default plans, built without its general machinery for plain tensors (dcp/fast_planner.py): the
        # same plans and metadata, 7 ms -> 2 ms of a save of 266 tensors here (docs/benchmarks.md, Managed saves)
        planner = FastSavePlanner()
        if not async_:
            result = dcp.save(state_dict, storage_writer=writer, planner=planner, process_group=process_group,
                              no_dist=not distributed())
            self._retain(process_group)
            return result
        response = dcp.async_save(state_dict, storage_writer=writer, planner=planner, process_group=process_group,
                                  async_stager=stager, no_dist=not distributed())
        upload = response.upload_completion if isinstance(response, AsyncSaveResponse) else response
        done: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def committed(f: concurrent.futures.Future[Any]) -> None:
            try:
                result = f.result()
            except BaseException as e:
                done.set_exception(e)
                return
            self._retain(process_group)
            done.set_result(result)

        upload.add_done_callback(committed)
        self._pending = done
        if isinstance(response, AsyncSaveResponse):
            return AsyncSaveResponse(staging_completion=response.staging_completion, upload_completion=done)
        return done

    def wait(self) -> None:
        """Wait for the last asynchronous save (and its retention); raise its error, once."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def _prepare(self, step: int) -> list[int]:
        """On the coordinator: the root marked (once), step ``step`` free; the newest committed step, as a list."""
        if not self._marked:
            self._root.check()
            self._root.mark()
            self._marked = True
        self._known.pop(step, None)
        return prepare_step(self._root, step)

    def _retain(self, group: Any) -> None:
        if not is_coordinator(group):
            return
        try:
            apply_retention(self._root, self.keep_last, self.keep_every, self._known)
        except Exception as e:  # the step is committed; what stays is dropped by the next retention
            _log.warning("mmapckpt: retention under %s failed (the next save retries it): %s", self.root, e)

    # ------------------------------------------------------------------ loading
    def load(self, state_dict: dict[str, Any], step: int | None = None, *, process_group: Any = None) -> int:
        """Load step ``step`` (the latest where None) into ``state_dict`` with ``dcp.load``, resharded as needed.

        Every rank calls it; the coordinator chooses the step and holds a lease on it while the ranks load, so that
        retention elsewhere does not remove it meanwhile.

        Args:
            state_dict: what ``dcp.load`` takes (filled in place).
            step: the step to load; None: the newest committed step.
            process_group: the group of the ranks loading; the default group where None.

        Returns:
            The step loaded.

        Raises:
            CheckpointNotFoundError: no such committed step (or none at all), naming it.
        """
        held: list[Lease] = []

        def choose() -> int:
            if held:  # again: retention removed the .metadata between our check and DCP's read, and puts it back
                return recommitted(self._root, held[-1].step, self.lease_seconds)
            held.append(self.lease(step))
            return held[-1].step

        try:
            for again in (False, True):
                chosen = decided(choose, process_group)
                reader = MmapReader(self.path(chosen), storage_options=self._root.options)
                try:
                    dcp.load(state_dict, storage_reader=reader, process_group=process_group,
                             no_dist=not distributed())
                    return chosen
                except BaseException as e:
                    gone = isinstance(checkpoint_error(e, reader), (CheckpointNotFoundError, IncompleteCheckpointError))
                    if again or not decided(lambda: gone, process_group):  # the ranks retry together, or none
                        raise
        finally:
            for lease in held:
                lease.release()
        raise AssertionError("unreachable")  # pragma: no cover

    def lease(self, step: int | None = None) -> Lease:
        """A lease on committed step ``step`` (the latest where None): retention keeps the step until it is released.

        For readers that do not go through :meth:`load`: ``with manager.lease(s): mmapckpt.open(manager.path(s))``.

        Raises:
            CheckpointNotFoundError: no such committed step (or none at all).
        """
        return lease_committed(self._root, None if step is None else _checked(step), self.lease_seconds)


def _checked(step: Any) -> int:
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"a step is an int >= 0, not {step!r}")
    return step


