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

from collections.abc import Collection, Iterable

from ..errors import CheckpointError, CheckpointExistsError, CheckpointWriteError
from ..format.metadata import METADATA_NAME, decode_index_file
from ..storage.leased_lock import LOCK_NAME  # an object store's save lock object, which a killed save leaves behind
from .leases import live_leases
from .root import Root, root_relative, step_dir

__all__ = ["retained", "names_of", "apply_retention", "clear_step", "references", "prepare_step", "LOCK_NAME", "Known"]



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
    f = root.step_storage(step).read_metadata()
    entries, _ = decode_index_file(f.kind, f.data, f.full)  # the package's own decoding of the bytes read
    names = {f"{step_dir(step)}/{METADATA_NAME}"}
    for e in entries.values():
        for c in e.chunks:
            name = root_relative(step, c.file)
            if name is not None:
                names.add(name)
    return names, bytes(f.data)


#: step -> what :func:`names_of` read of it: a committed step's ``.metadata`` never changes (saves never overwrite)
Known = dict[int, tuple[set[str], bytes]]


def apply_retention(root: Root, keep_last: int | None, keep_every: int | None, known: Known | None = None) -> list[int]:
    """Drop the committed steps that :func:`retained` does not keep and no lease holds, and clear what killed saves
    and retentions left below the newest step; return the steps dropped. ``known``: names read before (kept up to
    date here), so that each step's ``.metadata`` is read once."""
    known = {} if known is None else known
    objects = root.objects()
    dirs = root.step_dirs(objects, uploads=True)
    committed = sorted(s for s, c in dirs.items() if c)
    for s in set(known) - set(committed):
        del known[s]
    for s in committed[:-1]:  # a save killed after its commit, before it released its lock object: ours to remove
        if f"{step_dir(s)}/{LOCK_NAME}" in objects:
            root.step_storage(s).remove([LOCK_NAME], sync=False)
    leftovers = [s for s, c in dirs.items() if committed and not c and s < committed[-1]]
    doomed = [s for s in committed if s not in retained(committed, keep_last, keep_every)]
    if not doomed and not leftovers:
        return []
    leased = live_leases(root, tidy=True)
    drop = [s for s in doomed if s not in leased]
    for s in committed:  # a step that cannot be read might name anything: then nothing is removed
        if s not in known:
            known[s] = names_of(root, s)
    for s in drop:
        root.step_storage(s).remove([METADATA_NAME], sync=True)
    back = live_leases(root) & set(drop) if drop else set()  # leased after the first look: the reader saw the
    for s in sorted(back):                                    # commit, so it gets it back before anything goes
        root.step_storage(s).commit(METADATA_NAME, known[s][1], sync=True)
    dropped = [s for s in drop if s not in back]
    referenced: set[str] = set()
    for s in committed:
        if s not in dropped:
            referenced |= known[s][0]
    for s in dropped + leftovers:
        known.pop(s, None)
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


def prepare_step(root: Root, step: int) -> list[int]:
    """Before a save of step ``step``: refuse a committed one, and remove what a save of it that did not commit left
    (its files, uploads and lock object are the manager's own: docs/manager.md); the newest committed step, as a
    list (empty before the first)."""
    dirs = root.step_dirs()
    if dirs.get(step):
        raise CheckpointExistsError(f"step {step} is already committed, and a managed save never overwrites: save "
                                    "under a new step number", path=root.join(step_dir(step)))
    committed = sorted(s for s, c in dirs.items() if c)
    if step in dirs:
        left = clear_step(root, step, references(root, committed))
        if left:
            raise CheckpointWriteError(f"step {step} was dropped, but committed steps still refer to its files "
                                       f"({', '.join(sorted(left))}): save under a new step number",
                                       path=root.join(step_dir(step)))
    return committed[-1:]
