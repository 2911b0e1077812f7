"""A remote checkpoint read through the local cache: the medium's files served from checked local copies.

:class:`CachedStorage` wraps the storage of a URL (any medium: S3, or whatever ``register_scheme``
serves) and is itself a storage whose files can be mapped. Opening a file asks the medium which
version it holds now (its size and identity: one HEAD on S3, through the medium's ``version``
method where it has one, else by opening the file), then serves the cached copy of that version
(entry.py), or fetches it first, once across processes (the entry's lock), and evicts what the
size bound asks (evict.py). A file the medium no longer has is never served from the cache. Where
the cache directory cannot take a copy (no room, no permission) the file is read from the medium,
uncached, with a warning.

Everything else is the medium's: listing, existence, and every write (a save to a URL with the
cache on writes to the store; the next load finds the new versions and fetches them).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from ...errors import IncompleteCheckpointError
from ..base import CheckpointStorage, FileOutput, Lock, StoredFile
from ..replacement import Owned, Replacement
from .entry import Entry, ident_of
from .evict import evict
from .settings import CacheSettings

__all__ = ["CachedStorage"]

log = logging.getLogger("mmapckpt")


class CachedStorage(CheckpointStorage):
    """The remote storage ``remote`` with its files served from the cache ``settings`` names (module docstring).

    Attributes:
        remote: the medium's storage (its ``stats``, where it counts its transfers, are what the store sent).
        settings: the cache's directory and size bound.
        fetched: names of the files this storage fetched into the cache (the rest were served from it).
    """

    can_map = True

    def __init__(self, remote: CheckpointStorage, settings: CacheSettings) -> None:
        self.remote, self.settings = remote, settings
        self.location = remote.location
        self.fetched: list[str] = []
        # the version of each file found at this storage's first look (one storage serves one load, as the
        # medium's own storage keeps what it found: storage/s3/storage.py)
        self._versions: dict[str, list[Any] | None] = {}

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name in ("remote", "settings"):
            raise AttributeError(name)
        return getattr(self.remote, name)  # the medium's own attributes (stats, opts, client)

    def full(self, name: str) -> str:
        return self.remote.full(name)

    def _version(self, name: str) -> list[Any] | None:
        if name in self._versions:
            return self._versions[name]
        ask = getattr(self.remote, "version", None)
        if ask is not None:
            found = ask(name)
            version = None if found is None else ident_of(*found)
        else:
            try:
                with self.remote.open_file(name) as f:
                    version = ident_of(f.size, f.ident)
            except IncompleteCheckpointError:
                version = None
        self._versions[name] = version
        return version

    # ------------------------------------------------------------------ reading
    def exists(self, name: str) -> bool:
        return self._version(name) is not None

    def is_location(self) -> bool:
        return self.remote.is_location()

    def list(self) -> list[str]:
        return self.remote.list()

    def open_file(self, name: str) -> StoredFile:
        version = self._version(name)
        if version is None:
            raise IncompleteCheckpointError("no such object", path=self.full(name))
        entry = Entry(self.settings.root, self.full(name))
        f = entry.open_hit(version)
        if f is not None:
            return f
        try:
            with entry.locked():
                f = entry.open_hit(version)  # fetched meanwhile by the process this one waited for
                if f is None:
                    version = self._versions[name] = entry.fetch(self.remote, name)
                    self.fetched.append(name)
                    f = entry.open_hit(version)  # under the entry's lock: not evicted before it is open
        except OSError as e:
            log.warning("mmapckpt: the cache at %s cannot take %s (%s): reading it uncached",
                        self.settings.root, self.full(name), e.strerror or e)
            return self.remote.open_file(name)
        if f is None:  # changed under us (a process damaging the cache): read it uncached
            return self.remote.open_file(name)
        if self.settings.max_bytes is not None and self.fetched and self.fetched[-1] == name:
            evict(self.settings.root, self.settings.max_bytes, keep=entry.dir)
        return f

    # ------------------------------------------------------------------ writing: the medium's
    def prepare(self) -> None:
        self.remote.prepare()

    def create_file(self, name: str, size: int | None, *, head: int, direct: bool, sync: bool) -> FileOutput:
        self._versions.pop(name, None)
        return self.remote.create_file(name, size, head=head, direct=direct, sync=sync)

    def commit(self, name: str, data: bytes, *, sync: bool) -> None:
        self._versions.pop(name, None)
        self.remote.commit(name, data, sync=sync)

    def remove(self, names: Iterable[str], *, sync: bool) -> None:
        names = list(names)
        for n in names:
            self._versions.pop(n, None)
        self.remote.remove(names, sync=sync)

    def lock(self, *, shared: bool = False) -> Lock:
        return self.remote.lock(shared=shared)

    def sync(self) -> None:
        self.remote.sync()

    def replacement(self, name: str = "", *, owned: Owned = frozenset, overwrite: bool = True) -> Replacement:
        self._versions.clear()
        return self.remote.replacement(name, owned=owned, overwrite=overwrite)

    def recover(self) -> str | None:
        return self.remote.recover()
