"""``mmapckpt inspect ROOT``: the steps of a managed root, with their sizes and the bytes they share.

For each step: the bytes of the files its ``.metadata`` names (what loading it reads), the bytes
of those stored under its own directory, and the bytes it refers to in other steps' directories
(``shared``: nonzero once unchanged chunks are stored once, docs/format.md). The totals compare
what the steps hold with what the root stores. Step directories without ``.metadata`` (a save
in progress or killed, a step being dropped) are listed as incomplete.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from ..conversion.progress import human_bytes
from ..errors import CheckpointError
from .root import Root, step_dir

__all__ = ["StepSummary", "RootInfo", "describe_root", "format_root", "inspect_root"]


@dataclass(frozen=True)
class StepSummary:
    """One step directory of a root.

    Attributes:
        step: the step number.
        committed: whether it holds ``.metadata`` (only then is it a step).
        files: files it names (committed) or holds (incomplete).
        bytes: bytes of those files.
        own_bytes: bytes of them stored under its own directory.
        shared_bytes: bytes of them stored in other steps' directories (unchanged chunks stored once).
        leased: whether a load holds a lease on it.
    """

    step: int
    committed: bool
    files: int
    bytes: int
    own_bytes: int
    shared_bytes: int
    leased: bool


@dataclass(frozen=True)
class RootInfo:
    """A managed root: its steps and what it stores (``stored_bytes``: every file under its step directories)."""

    path: str
    steps: tuple[StepSummary, ...]
    stored_bytes: int

    def to_json(self) -> dict[str, Any]:
        committed = [s for s in self.steps if s.committed]
        return {"path": self.path, "format": "mmapckpt-root", "steps": [asdict(s) for s in self.steps],
                "totals": {"steps": len(committed), "bytes": sum(s.bytes for s in committed),
                           "stored_bytes": self.stored_bytes}}


def describe_root(path: str | os.PathLike[str], *, storage_options: Mapping[str, Any] | None = None) -> RootInfo | None:
    """The steps of the managed root at ``path``, or None where ``path`` is no managed root (no marker)."""
    root = Root(path, storage_options)
    try:
        if not root.check():
            return None
    except CheckpointError:
        return None
    from .leases import live_leases  # only for a root: the CLI's hook costs any other inspect one marker lookup
    from .retention import names_of

    objects = root.objects()
    leased = live_leases(root)
    steps = []
    for step, committed in sorted(root.step_dirs(objects).items()):
        d = f"{step_dir(step)}/"
        if committed:
            names = names_of(root, step)[0]
        else:
            names = {n for n in objects if n.startswith(d)}
        sizes = {n: objects.get(n, 0) for n in names}
        own = sum(v for n, v in sizes.items() if n.startswith(d))
        steps.append(StepSummary(step, committed, len(names), sum(sizes.values()), own, sum(sizes.values()) - own,
                                 step in leased))
    return RootInfo(os.fspath(path), tuple(steps), sum(objects.values()))


def format_root(info: RootInfo) -> str:
    """The human-readable report: one row per step directory, then the totals."""
    rows = [("step", "files", "bytes", "own", "shared", "")]
    for s in info.steps:
        note = ("leased" if s.leased else "") if s.committed else "incomplete (no .metadata)"
        rows.append((str(s.step), str(s.files), human_bytes(s.bytes), human_bytes(s.own_bytes),
                     human_bytes(s.shared_bytes), note))
    widths = [max(len(r[i]) for r in rows) for i in range(6)]
    committed = [s for s in info.steps if s.committed]
    lines = [f"{info.path}: managed root, {len(committed)} step{'' if len(committed) == 1 else 's'}"
             + (f" (latest {committed[-1].step})" if committed else ""), ""]
    for r in rows:
        lines.append("  ".join(c.ljust(w) if i in (0, 5) else c.rjust(w)
                               for i, (c, w) in enumerate(zip(r, widths))).rstrip())
    held = sum(s.bytes for s in committed)
    lines += ["", f"total: the steps hold {human_bytes(held)} ({held} bytes); the root stores "
                  f"{human_bytes(info.stored_bytes)} ({info.stored_bytes} bytes)"]
    return "\n".join(lines)


def inspect_root(path: str, *, as_json: bool = False) -> str | None:
    """What ``mmapckpt inspect`` prints for a managed root, or None where ``path`` is none (the CLI's hook)."""
    info = describe_root(path)
    if info is None:
        return None
    return json.dumps(info.to_json(), indent=2) if as_json else format_root(info)
