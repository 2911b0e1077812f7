"""Retention: which steps stay, and removing the others without ever breaking one that stays.

Run by the coordinator after each committed save (``manager.py``). To drop step S it removes
``step-S/.metadata`` first (S is then no step), then every file under ``step-S/`` that no
retained committed step's ``.metadata`` names, then the directory once empty. "Names" come from
the storage records alone (``storage/commits.py`` ``read_index``: the package's own metadata
decoding), each normalised against its step's directory to a root-relative name, so a file
another step refers to (``../step-S/NAME``, docs/format.md) stays until no retained step names
it: retention is correct with or without unchanged chunks stored once.

A step some live lease holds (``leases.py``) is not dropped; it goes at a later retention once
its lease is gone. The leases are read again after the ``.metadata`` files are removed, and a
step found leased then gets its ``.metadata`` back before anything else is removed.

A kill at any moment leaves every retained step whole: nothing a retained step names is ever
removed, and a step whose ``.metadata`` is gone is no step. What a killed retention or a killed
save left (step directories without ``.metadata``, older than the newest step) is removed by
the next retention in the same way; a newer one by the next save of that step (:func:`clear_step`).
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable

from ..errors import CheckpointError, CheckpointWriteError
from ..format.metadata import METADATA_NAME, MAX_METADATA_SIZE
from ..storage.commits import read_index
from .leases import live_leases
from .root import Root, root_relative, step_dir

__all__ = ["retained", "names_of", "apply_retention", "clear_step", "LOCK_NAME"]

#: An object store's save lock object (``storage/s3/lock.py``), which a killed save leaves in its step's prefix.
LOCK_NAME = ".mmapckpt-lock"
_log = logging.getLogger("mmapckpt")


def retained(steps: Iterable[int], keep_last: int | None, keep_every: int | None) -> set[int]:
    """The steps to keep: all where ``keep_last`` is None; else the last ``keep_last`` (at least the newest)
    and every multiple of ``keep_every``."""
    ordered = sorted(steps)
    if keep_last is None:
        return set(ordered)
    keep = set(ordered[-max(keep_last, 1):]) if ordered else set()
    if keep_every:
        keep |= {s for s in ordered if s % keep_every == 0}
    return keep


def names_of(root: Root, step: int) -> tuple[set[str], bytes]:
    """The root-relative files step ``step``'s ``.metadata`` names (itself included), and the metadata's bytes."""
    storage = root.step_storage(step)
    data = bytes(storage.read_file(METADATA_NAME, MAX_METADATA_SIZE))
    _, entries, _ = read_index(storage)
    names = {f"{step_dir(step)}/{METADATA_NAME}"}
    for e in entries.values():
        for c in e.chunks:
            name = root_relative(step, c.file)
            if name is not None:
                names.add(name)
    return names, data


def apply_retention(root: Root, keep_last: int | None, keep_every: int | None) -> list[int]:
    """Drop the committed steps that :func:`retained` does not keep and no lease holds, and clear what killed saves
    and retentions left below the newest step; return the steps dropped."""
    dirs = root.step_dirs()
    committed = sorted(s for s, c in dirs.items() if c)
    if not committed:
        return []
    newest = committed[-1]
    keep = retained(committed, keep_last, keep_every)
    doomed = [s for s in committed if s not in keep]
    leased = live_leases(root, tidy=True)
    drop = [s for s in doomed if s not in leased]
    names: dict[int, tuple[set[str], bytes]] = {}
    for s in committed:  # a retained step that cannot be read might name anything: remove nothing
        if s in keep or s in drop or s in leased:
            names[s] = names_of(root, s)
    for s in drop:
        root.step_storage(s).remove([METADATA_NAME], sync=True)
    back = live_leases(root) & set(drop)  # leased after the first look: the reader saw the commit; put it back
    for s in sorted(back):
        root.step_storage(s).commit(METADATA_NAME, names[s][1], sync=True)
    dropped = [s for s in drop if s not in back]
    referenced: set[str] = set()
    for s in committed:
        if s not in dropped:
            referenced |= names[s][0] if s in names else set()
    leftovers = [s for s, c in dirs.items() if not c and s < newest]
    for s in dropped + leftovers:
        clear_step(root, s, referenced)
    return dropped


def clear_step(root: Root, step: int, referenced: Collection[str]) -> list[str]:
    """Remove every file under ``step-{step}/`` (a killed save's uploads and lock object included) that no name of
    ``referenced`` is; then the directory once empty. Returns the files left (those referenced)."""
    storage = root.step_storage(step)
    d = step_dir(step)
    files = storage.list()
    doomed = [n for n in files if f"{d}/{n}" not in referenced]
    left = [n for n in files if f"{d}/{n}" in referenced]
    if METADATA_NAME in doomed:  # first: from then on it is no step
        storage.remove([METADATA_NAME], sync=True)
    storage.remove([n for n in doomed if n != METADATA_NAME] + [LOCK_NAME], sync=True)
    if not left:
        root.remove_dir(step)
    return left


def references(root: Root, committed: Iterable[int], skip: int | None = None) -> set[str]:
    """Every root-relative file the committed steps (but ``skip``) name; a step that cannot be read raises."""
    out: set[str] = set()
    for s in committed:
        if s != skip:
            try:
                out |= names_of(root, s)[0]
            except CheckpointError as e:
                raise CheckpointWriteError(f"cannot read step {s}'s metadata, so nothing under the root can be "
                                           f"removed safely: {e}", path=root.join(step_dir(s))) from e
    return out
