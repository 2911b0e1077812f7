"""A new version of a checkpoint written so that its location holds the old or the new one at every instant.

A conversion (``convert --overwrite``) writes a whole checkpoint, maybe of another format, over
what a location holds. :meth:`CheckpointStorage.replacement` gives a :class:`Replacement`: the
storage to write the new files into, the names they must not take, and the commit that puts the
new version in place. Every medium writes the new files through the same ``create_file`` and
``commit`` calls; where they go and how the new version replaces the old one is the medium's:

- :class:`InPlace` (the default, every medium without renames: an object store): the new files
  are written into the location itself under names no file there has (``avoid``), the new
  commit file (``.metadata``, an index) replaces the old one atomically, and only then are the
  old version's files that the new one does not use removed. A file output is one
  ``FileOutput``, which appears whole or not at all.
- the local directory (storage/local.py ``Swap``): the new version is written beside the old
  one, under a temporary name, and swapped in by one exchange (storage/replace.py), with a
  journal that the next conversion's :meth:`CheckpointStorage.recover` finishes or undoes.

Either way a failure removes only what the conversion wrote, and files of other names at the
location (configs, tokenizers, notes) are never removed.
"""

from __future__ import annotations

import abc
import os
import tempfile
import uuid
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # base.py makes the default replacement (InPlace): only annotations name it here
    from .base import CheckpointStorage

__all__ = ["Replacement", "InPlace", "Owned"]

#: The names of the files of the old version (its checkpoint's own files), asked when needed.
Owned = Callable[[], Collection[str]]


class Replacement(abc.ABC):
    """A new version being written (see the module docstring).

    Attributes:
        storage: where the new version's files are written (``create_file``, ``commit``).
        name: a file output's name in :attr:`storage`; ``""`` for a directory output.
        avoid: names the new files must not take (files of the old version, in use until the new commit).
        target: the full name of what is replaced, for messages.
        created: the data files finished so far (:meth:`abort` removes them).
    """

    storage: CheckpointStorage
    name: str
    avoid: frozenset[str]
    target: str

    def __init__(self) -> None:
        self.created: list[str] = []

    def add(self, name: str) -> None:
        """Record data file ``name`` as written (complete under its name)."""
        self.created.append(name)

    @abc.abstractmethod
    def commit(self, commit: str) -> list[str]:
        """Put the finished new version in place; ``commit`` is its commit file (a directory's ``.metadata`` or
        index; a file output's own name). Returns hidden names where entries that could be neither kept nor
        removed were put (the caller warns).

        Raises:
            CheckpointExistsError: the destination appeared while the new version was written (no overwrite).
            CheckpointWriteError: the new version could not be put in place (the old one is still there).
        """

    @abc.abstractmethod
    def abort(self) -> None:
        """Give up after a failure: remove what was written; the old version stays (errors are ignored)."""

    def scratch(self) -> str:
        """A new local path for a scratch file that the writer removes (a torch.save output is assembled in one):
        beside the destination where it is local, else in the system's temporary directory."""
        return os.path.join(tempfile.gettempdir(), f"mmapckpt-scratch-{uuid.uuid4().hex[:12]}")

    def close(self) -> None:
        """Release what the replacement holds (a lock on the new version)."""

    def __enter__(self) -> "Replacement":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class InPlace(Replacement):
    """The new version written into the location itself (see the module docstring)."""

    def __init__(self, storage: CheckpointStorage, name: str, owned: Owned) -> None:
        super().__init__()
        self.storage, self.name = storage, name
        self.target = storage.full(name) if name else storage.location
        if name:  # one file: its FileOutput replaces it whole
            self.avoid, self._old = frozenset(), frozenset()
        else:
            self.avoid = frozenset(storage.list())
            self._old = frozenset(owned())

    def commit(self, commit: str) -> list[str]:
        stale = self._old - set(self.created) - {commit}
        is_commit = [n for n in stale if n == ".metadata" or n.endswith((".metadata", ".index.json"))]
        self.storage.remove(sorted(is_commit), sync=False)  # no commit names the old files any more
        self.storage.remove(sorted(stale - set(is_commit)), sync=True)
        return []

    def abort(self) -> None:
        self.storage.remove(self.created, sync=True)  # the files it finished; the one being written was aborted
