"""Where a path or URL names a checkpoint: a directory, or one file of a directory.

A local path is what the file system says: a directory, or a file (links followed, as
``open`` follows them); a place that leads to another (the root of a repository of a Hugging Face
hub cache) is resolved by the format table (reading/formats.py). A URL (``scheme://...``, a medium registered with
``storage/location.py`` ``register_scheme``) names files and directories as object stores
do: ``scheme://a/b`` is a directory where files exist under ``a/b/``
(:meth:`CheckpointStorage.is_location`), else a file where ``a/b`` itself is one: file ``b``
of the storage of ``scheme://a``, its parent, through which it is opened. A URL ending in
``/`` names a directory only.

Every format's reader opens its files through a :class:`Place`, so the same code reads a
local directory and a prefix of an object store.
"""

from __future__ import annotations

import os
import posixpath
from collections.abc import Mapping
from typing import Any

from ..errors import CheckpointNotFoundError
from ..io.files import open_inside
from ..records import Record
from ..storage.base import CheckpointStorage, StoredFile
from ..storage.hub import hub_blobs
from ..storage.local import LocalFile
from ..storage.location import is_url, storage_for

__all__ = ["Place", "locate", "split_url"]


def split_url(url: str) -> tuple[str, str]:
    """``(parent URL, base name)`` of a URL; the name is ``""`` where the URL can name no file (it ends in
    ``/``, or has no parent: ``s3://bucket``)."""
    scheme, rest = url.split("://", 1)
    if not rest or rest.endswith("/"):
        return url, ""
    head, _, name = rest.rpartition("/")
    if not head.strip("/"):
        return url, ""
    return f"{scheme}://{head}", name


class Place(Record):
    """A checkpoint's location: a directory, or file ``name`` of the directory ``storage``.

    Attributes:
        path: the location as named (a path or a URL), for messages.
        storage: the directory's storage, or the storage of the file's parent directory.
        name: None for a directory; the file's name in ``storage`` for a file.
        local: a local path (files are opened as the file system resolves them).
        parent: for a file, its directory as named (``"."`` for a bare local file name).
    """

    __slots__ = ()

    path: str
    storage: CheckpointStorage
    name: str | None
    local: bool
    parent: str

    def __new__(cls, path: str, storage: CheckpointStorage, name: str | None, local: bool, parent: str = "") -> Place:
        return tuple.__new__(cls, (path, storage, name, local, parent))

    @property
    def is_dir(self) -> bool:
        return self.name is None

    @property
    def root(self) -> str:
        """The directory the names of the checkpoint's files are relative to."""
        return self.path if self.name is None else self.parent

    def directory(self) -> Place:
        """The directory holding this file (itself for a directory)."""
        if self.name is None:
            return self
        return Place(self.parent, self.storage, None, self.local)

    def inside(self, rel: str) -> str:
        """``rel`` (a name a directory's index gives), normalised. Locally it is refused (UnsafePathError) where
        it resolves outside the directory (links are followed only into the ``blobs/`` of a Hugging Face hub
        cache: storage/hub.py); a medium's storage refuses such a name itself when it is opened."""
        if self.local:
            open_inside(self.root, rel, links_into=hub_blobs(os.path.realpath(self.root)))
            return os.path.normpath(rel)
        return posixpath.normpath(rel)

    def full(self, rel: str | None = None) -> str:
        """The name of file ``rel`` of the directory (None: the file this place names), for messages."""
        if rel is None or (self.name is not None and rel == self.name):
            return self.path if self.name is not None else self.root
        return os.path.join(self.root, rel) if self.local else self.storage.full(rel)

    def exists(self, rel: str) -> bool:
        """Whether file ``rel`` of the directory is there (a regular file)."""
        return os.path.isfile(self.full(rel)) if self.local else self.storage.exists(rel)

    def open(self, rel: str | None = None) -> StoredFile:
        """File ``rel`` of the directory (None: the file this place names), open for reading."""
        if rel is None:
            rel = self.name
            if rel is None:
                raise IsADirectoryError(self.path)
        if self.local and rel == self.name:  # a file named by the caller: opened as the file system resolves it
            return LocalFile(self.full(rel))
        return self.storage.open_file(rel)  # a name inside the directory: the storage keeps it inside


def locate(location: str | os.PathLike[str], *, options: Mapping[str, Any] | None = None) -> Place:
    """The :class:`Place` ``location`` names (see the module docstring).

    ``options`` are the caller's ``storage_options``, for the medium of a URL.

    Raises:
        CheckpointNotFoundError: nothing there; a local path that is neither file nor directory; a URL of
            a scheme no medium serves; a hub cache repository without the snapshot its ``refs/main`` names.
    """
    p = os.fspath(location)
    if not is_url(p):
        if os.path.isdir(p):
            return Place(p, storage_for(p), None, True)
        if not os.path.exists(p):
            raise CheckpointNotFoundError("no such file or directory", path=p)
        if not os.path.isfile(p):
            raise CheckpointNotFoundError("not a checkpoint file or directory", path=p)
        parent = os.path.dirname(p) or "."
        return Place(p, storage_for(parent), os.path.basename(p), True, parent)
    storage = storage_for(p, options=options)
    if storage.is_location():
        return Place(p, storage, None, False)
    parent, name = split_url(p)
    if name:
        up = storage_for(parent, options=options)
        if up.exists(name):
            return Place(p, up, name, False, parent)
    raise CheckpointNotFoundError("no such file or directory (no file of this name, and none under it)", path=p)
