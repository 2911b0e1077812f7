"""The commit files of a checkpoint: reading them, naming what a save writes, and removing what no commit references.

A save over an existing checkpoint is old or new at every instant, never neither. The one
commit point is the atomic replacement of the metadata file (``.metadata``, or
``__{rank}.metadata`` for a save with use_collectives=False: :meth:`CheckpointStorage.commit`).
Until then the old commit and every file it names stay untouched: new shard files never take
the name of a shard file at the location (:func:`shard_name`), so never one a commit
references. Only after the new commit is durable are the files that no commit references any
more removed (:func:`remove_stale`): the old checkpoint's shards, and the leftovers of killed
saves. Files of other names are never touched. A save holds the location's lock
(:meth:`CheckpointStorage.lock`) from planning to commit.

Reading: :func:`read_index` (the entry index every reader uses), :func:`read_user_metadata`;
each reads the commit through the storage and decodes it with ``format/metadata/`` (codec.py).
DCP's ``Metadata`` of a commit is built by the DCP adapter (``dcp/metadata.py`` ``read_metadata``):
nothing here imports ``torch.distributed``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

from ..errors import CheckpointError, CheckpointExistsError, CheckpointWriteError, IncompleteCheckpointError
from ..format.entries import EntryInfo, paused_gc
from ..format.metadata import (
    METADATA_NAME,
    decode_index_file,
    decode_user_metadata,
    encode_metadata,
)
from .base import CheckpointStorage, Lock
from .local import LocalStorage

__all__ = ["SHARD_SUFFIX", "metadata_name", "commit_files", "committed_files", "existing_shards", "shard_name",
           "remove_stale", "begin_save", "commit_save", "read_index", "read_user_metadata", "missing_shard_error",
           "read_index_file", "read_user_metadata_file"]

SHARD_SUFFIX = ".distcp"
#: Files of a DCP checkpoint's own making, the only ones a save ever removes.
_SHARD = re.compile(r"__\d+_\d+(\.[0-9a-f]{8})?\.distcp\Z")
_RANK_COMMIT = re.compile(r"__\d+\.metadata\Z")
_TEMP = re.compile(r"\.(__\d+_\d+(\.[0-9a-f]{8})?\.distcp|(__\d+)?\.metadata)\.tmp-[0-9a-z]+\Z")


# --------------------------------------------------------------------------- reading a commit
def read_index(storage: CheckpointStorage, name: str = METADATA_NAME) -> tuple[str, Mapping[str, EntryInfo], str | None]:
    """(kind, entries by name, save id) of commit file ``name``; every entry checked."""
    f = storage.read_metadata(name)
    return (f.kind, *decode_index_file(f.kind, f.data, f.full))


def read_user_metadata(storage: CheckpointStorage, name: str = METADATA_NAME) -> dict[str, str] | None:
    """The ``{str: str}`` user metadata commit file ``name`` carries, or None."""
    f = storage.read_metadata(name)
    return decode_user_metadata(f.kind, f.data, f.full)


def read_index_file(path: str | os.PathLike[str]) -> tuple[str, Mapping[str, EntryInfo], str | None]:
    """:func:`read_index` of a local commit file's path."""
    d, name = os.path.split(os.fspath(path))
    return read_index(LocalStorage(d or "."), name)


def read_user_metadata_file(path: str | os.PathLike[str]) -> dict[str, str] | None:
    """:func:`read_user_metadata` of a local commit file's path."""
    d, name = os.path.split(os.fspath(path))
    return read_user_metadata(LocalStorage(d or "."), name)


def missing_shard_error(storage: CheckpointStorage, path: str, save_id: str | None,
                        entry: str | None = None) -> IncompleteCheckpointError:
    """The error for a shard file (full name ``path``) the metadata read names but the location lacks.

    A save over the checkpoint removes the old shards after its commit, so a load that
    read the old metadata just before can find them gone: say so when the committed
    metadata now belongs to another save, so that loading again is the fix.
    """
    try:
        _, _, now = read_index(storage)
    except (OSError, CheckpointError):
        now = save_id
    if now != save_id:
        return IncompleteCheckpointError(
            "shard file named in the metadata is missing: the checkpoint was replaced while it was being loaded "
            f"(metadata of save {save_id}, now {now}); load it again", path=path, entry=entry)
    return IncompleteCheckpointError("shard file named in the metadata is missing", path=path, entry=entry)


# --------------------------------------------------------------------------- what a save writes and removes
def metadata_name(rank: int | None) -> str:
    """The commit file: ``.metadata``, or ``__{rank}.metadata`` for a save with use_collectives=False."""
    return METADATA_NAME if rank is None else f"__{rank}{METADATA_NAME}"


def commit_files(storage: CheckpointStorage) -> list[str]:
    """Every commit at the location: ``.metadata`` and the per-rank ``__{rank}.metadata`` files."""
    names = storage.list()
    ranks = sorted(n for n in names if _RANK_COMMIT.match(n))
    return ([METADATA_NAME] if METADATA_NAME in names and storage.exists(METADATA_NAME) else []) + ranks


def committed_files(storage: CheckpointStorage, commits: list[str]) -> set[str]:
    """The file names the commit files ``commits`` reference.

    A commit that cannot be read counts as referencing every shard file there: nothing it
    might name is ever reused or removed because of it.
    """
    names: set[str] = set()
    for meta in commits:
        try:
            _, entries, _ = read_index(storage, meta)
        except (CheckpointError, OSError):
            names.update(existing_shards(storage))
            continue
        names.update(c.file for e in entries.values() for c in e.chunks)
    return names


def existing_shards(storage: CheckpointStorage) -> set[str]:
    """The shard files at the location: whatever a commit there may reference (new shards avoid them all).

    Listing the location, rather than decoding the old metadata, keeps the cost per save
    independent of the old checkpoint's entry count.
    """
    return {n for n in storage.list() if n.endswith(SHARD_SUFFIX)}


def shard_name(prefix: str, k: int, save_id: str, avoid: frozenset[str] | set[str]) -> str:
    """``{prefix}{k}.distcp`` (DCP's own name), or with the save id in it where that name is taken."""
    name = f"{prefix}{k}{SHARD_SUFFIX}"
    if name in avoid:
        name = f"{prefix}{k}.{save_id.replace('-', '')[:8]}{SHARD_SUFFIX}"
    if name in avoid:  # cannot happen for a fresh save id; refuse rather than overwrite a committed file
        raise CheckpointWriteError("no free shard file name (both candidates exist)", path=name)
    return name


def begin_save(storage: CheckpointStorage, path: str, *, overwrite: bool, lock: bool,
               shared: bool = False) -> Lock | None:
    """A save's start at ``storage`` (``path``, as the caller named it, for the error): the location prepared, its
    save lock taken (``lock``; ``shared``: a per-rank save's), and an existing checkpoint refused unless
    ``overwrite``. Returns the lock held."""
    storage.prepare()
    held = storage.lock(shared=shared) if lock else None
    if commit_files(storage) and not overwrite:
        if held is not None:
            held.release()
        raise CheckpointExistsError("Checkpoint already exists and overwrite=False: pass overwrite=True to "
                                    "replace it (the old one stays loadable until the new one is committed)",
                                    path=path)
    return held


def commit_save(storage: CheckpointStorage, target: str, metadata: Any, *, user_metadata: Mapping[str, str] | None,
                references: Mapping[str, str] | None, files: set[str], rank_prefix: str | None, sync: bool) -> None:
    """A save's commit: ``metadata`` (DCP's ``Metadata``, or format/metadata/written.py's) encoded with the
    user's and the cross-step ``references``, put in place as ``target`` in one atomic step, durable (``sync``),
    then what no commit references any more removed (:func:`remove_stale`)."""
    try:
        with paused_gc():  # one object per entry to encode: the collector's passes would dominate
            data = encode_metadata(metadata, user_metadata, references=references)
    except (TypeError, ValueError) as e:
        raise CheckpointWriteError(f"cannot encode the checkpoint metadata: {e}", path=storage.full(target)) from e
    storage.commit(target, data, sync=sync)
    remove_stale(storage, keep_commit=target, keep_files=files, rank_prefix=rank_prefix, sync=sync)


def remove_stale(storage: CheckpointStorage, *, keep_commit: str, keep_files: set[str], rank_prefix: str | None, sync: bool) -> None:
    """After a durable commit: remove what no commit references any more.

    ``keep_commit`` is the commit just written and ``keep_files`` the files it references.
    A collective save (``rank_prefix`` None)
    removes the per-rank commits of an earlier use_collectives=False save, then every shard
    and temporary file of DCP's making that ``.metadata`` does not reference. A per-rank save
    removes ``.metadata`` (an earlier collective save's commit, which would otherwise load as
    a checkpoint older than this rank's), then only its own rank's unreferenced shards and
    temporary files: other ranks may still be writing theirs. Files of other names (notes,
    configs) are never touched. Errors are ignored: what stays is removed next time.
    """
    names = storage.list()
    if rank_prefix is None:
        doomed = [n for n in names if _RANK_COMMIT.match(n)]
    else:
        doomed = [METADATA_NAME] if METADATA_NAME in names else []
    storage.remove(doomed, sync=False)
    keep = set(keep_files)
    if rank_prefix is not None:  # the other ranks' commits still name their files
        keep |= committed_files(storage, [n for n in commit_files(storage) if n != keep_commit])
    own = () if rank_prefix is None else (rank_prefix, f"{rank_prefix[:-1]}{METADATA_NAME}.tmp-")
    mine = (lambda n: True) if rank_prefix is None else (lambda n: n.lstrip(".").startswith(own))
    storage.remove([n for n in names if n not in keep and (_SHARD.match(n) or _TEMP.match(n)) and mine(n)],
                   sync=sync)
