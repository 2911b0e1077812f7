"""A remote checkpoint read through the local cache: the medium's files served from checked local copies.

:class:`CachedStorage` wraps the storage of a URL (any medium: S3, or whatever ``register_scheme``
serves) and is itself a storage whose files can be mapped. Opening a file asks the medium which
version it holds now (its size and identity: one HEAD on S3, through the medium's ``version``
method where it has one, else by opening the file), then serves the cached copy of that version
(entry.py), or fetches it, once across processes (the entry's lock), serving the load the ranges
fetched and checked while the rest arrives (filling.py), and evicts what the size bound asks
(evict.py). A file the medium no longer has is never served from the cache. Where
the cache directory cannot take a copy (no room, no permission) the file is read from the medium,
uncached, with a warning.

Everything else is the medium's: listing, existence, and every write (a save to a URL with the
cache on writes to the store; the next load finds the new versions and fetches them).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from typing import Any

from ...errors import CheckpointError, IncompleteCheckpointError
from ...format.metadata import METADATA_NAME
from ..base import CheckpointStorage, FileOutput, Lock, StoredFile
from ..replacement import Owned, Replacement
from .entry import CachedFile, Entry, ident_of
from .evict import evict
from .filling import Filling
from .listing import Seen, is_mmapckpt, record_listing, recorded_listing
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
        self._listed: dict[str, Any] | None = None
        self._to_record = False  # the listing came from the medium: recorded once its commit is found mmapckpt
        self._seen = Seen(settings.root, self.full(METADATA_NAME))  # a medium without listings (listing.py)
        self._writing = False  # once it writes, it asks the medium itself (listings with uploads in progress)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name in ("remote", "settings"):
            raise AttributeError(name)
        return getattr(self.remote, name)  # the medium's own attributes (stats, opts, client)

    def full(self, name: str) -> str:
        return self.remote.full(name)

    def sibling(self, name: str) -> CachedStorage:
        """The medium's sibling location (another step of a managed root), read through the same cache."""
        return CachedStorage(self.remote.sibling(name), self.settings)

    def files_below(self) -> dict[str, int]:  # a managed root's steps: the medium's own listing, never a copy
        return self.remote.files_below()

    def unfinished_below(self) -> list[str]:
        return self.remote.unfinished_below()

    def _version(self, name: str) -> list[Any] | None:
        """The version of file ``name``: from the medium's one listing where the location was listed (S3: sizes
        and ETags), else one look at the file (a HEAD: ``version``; else opening it)."""
        if name in self._versions:
            return self._versions[name]
        listed = self._listed  # taken where the reader lists the location anyway (is_location, list): never
        found: Any = None if listed is None else listed.get(name)  # for one name (a bucket's root can be large)
        if found is None and listed is None and name != METADATA_NAME and self._unlisted():
            found = self._seen_before(name)
        if found is None:
            ask = getattr(self.remote, "version", None)
            if ask is not None:
                found = ask(name)
            else:
                try:
                    with self.remote.open_file(name) as f:
                        found = (f.size, f.ident)
                except IncompleteCheckpointError:
                    found = None
            if found is not None and self._unlisted():
                self._seen.found(name, found)
        version = None if found is None else ident_of(*found)
        self._versions[name] = version
        return version

    def _unlisted(self) -> bool:
        """Whether this is a medium without a listing of versions, only read so far."""
        return not self._writing and getattr(self.remote, "versions", None) is None

    def _seen_before(self, name: str) -> Any:
        """File ``name``'s version as recorded with the location's mmapckpt commit as it is now (listing.py Seen)."""
        commit = self._version(METADATA_NAME)
        return None if commit is None or not self._seen.take(commit) else (self._seen.files or {}).get(name)

    def _listing(self) -> dict[str, Any] | None:
        """``{name: (size, version)}`` of the location's files: recorded with its commit where that is the version
        the medium has now (listing.py), else from one listing (None: the medium has none)."""
        if self._listed is None and not self._writing:
            ask = getattr(self.remote, "versions", None)
            if ask is None:
                return None
            self._listed = self._recorded()
            if self._listed is None:
                self._listed = ask()
                self._to_record = True
        return self._listed

    def _recorded(self) -> dict[str, Any] | None:
        look = getattr(self.remote, "version", None)
        found = None if look is None else look(METADATA_NAME)
        if found is None:
            return None
        listed = recorded_listing(self.settings.root, self.full(METADATA_NAME), ident_of(*found))
        if listed is not None:
            self._versions[METADATA_NAME] = ident_of(*found)
        return listed

    def _record(self, f: StoredFile, version: list[Any]) -> None:
        """This load's listing (or versions found so far) recorded with mmapckpt commit ``f`` (listing.py)."""
        self._to_record = False
        if not is_mmapckpt(bytes(f.read(0, min(8, f.size)))):
            return
        listed = self._listed
        if listed is not None and METADATA_NAME in listed and ident_of(*listed[METADATA_NAME]) == version:
            record_listing(self.settings.root, self.full(METADATA_NAME), version, listed)
        elif listed is None and self._unlisted():
            self._seen.vouched(version)

    def _version_of(self, f: StoredFile) -> list[Any]:
        of = getattr(self.remote, "version_of", None)
        return ident_of(*(of(f) if of is not None else (f.size, f.ident)))

    # ------------------------------------------------------------------ reading
    def exists(self, name: str) -> bool:
        return self._version(name) is not None

    def is_location(self) -> bool:
        listed = self._listing()
        if listed is None and self._unlisted() and self._version(METADATA_NAME) is not None:
            return True  # a medium without listings: a commit is there (one look, which the load needs anyway)
        return bool(listed) or self.remote.is_location()

    def list(self) -> list[str]:
        """The medium's listing; while only reading, the names of the listing the versions came from (objects)."""
        listed = self._listing()
        return self.remote.list() if listed is None or self._writing else sorted(listed)

    def open_file(self, name: str) -> StoredFile:
        version = self._version(name)
        if version is None:
            raise IncompleteCheckpointError("no such object", path=self.full(name))
        f = self._open(name, version)
        if (name == METADATA_NAME and not self._writing and isinstance(f, CachedFile)
                and (self._to_record or (self._listed is None and self._seen.commit is None and self._unlisted()))):
            self._record(f, self._versions[name] or version)
        return f

    def _open(self, name: str, version: list[Any]) -> StoredFile:
        """The copy of file ``name`` at ``version``; where there is none, the copy being fetched (filling.py: served
        as it arrives), or the medium's file where the cache cannot take it."""
        entry = Entry(self.settings.root, self.full(name))
        f = entry.open_hit(version)
        if f is not None:
            return f
        try:
            return _fetched(self, entry, name, version)
        except CheckpointError:
            raise  # the store's failures (unreachable, denied, the file gone): as without a cache
        except OSError as e:
            log.warning("mmapckpt: the cache at %s cannot take %s (%s): reading it uncached",
                        self.settings.root, self.full(name), e.strerror or e)
            return self.remote.open_file(name)

    # ------------------------------------------------------------------ writing: the medium's
    def _written(self, names: Iterable[str] = ()) -> None:
        self._writing, self._listed = True, None
        for n in names:
            self._versions.pop(n, None)

    def prepare(self) -> None:
        self._written()
        self.remote.prepare()

    def create_file(self, name: str, size: int | None, *, head: int, direct: bool, sync: bool) -> FileOutput:
        self._written([name])
        return self.remote.create_file(name, size, head=head, direct=direct, sync=sync)

    def commit(self, name: str, data: bytes, *, sync: bool) -> None:
        self._written([name])
        self.remote.commit(name, data, sync=sync)

    def remove(self, names: Iterable[str], *, sync: bool) -> None:
        names = list(names)
        self._written(names)
        self.remote.remove(names, sync=sync)

    def lock(self, *, shared: bool = False) -> Lock:
        self._written()
        return self.remote.lock(shared=shared)

    def sync(self) -> None:
        self.remote.sync()

    def replacement(self, name: str = "", *, owned: Owned = frozenset, overwrite: bool = True) -> Replacement:
        self._written()
        self._versions.clear()
        return self.remote.replacement(name, owned=owned, overwrite=overwrite)

    def recover(self) -> str | None:
        return self.remote.recover()


def _fetched(cs: CachedStorage, entry: Entry, name: str, version: list[Any]) -> StoredFile:
    """File ``name``'s copy once ``#lock`` is taken: fetched meanwhile by the process this one waited for, or
    being fetched now by this one (filling.py: the lock passes to the fetch, released once the copy is in place)."""
    lock = entry.lock()
    try:
        f = entry.open_hit(version)
        if f is not None:
            return f
        filling = Filling(entry, cs.remote, name, cs._version_of, lock, after=lambda: _evict(cs.settings, entry))
        lock = -1
        cs._versions[name] = filling.version
        cs.fetched.append(name)
        return filling.file
    finally:
        if lock >= 0:
            os.close(lock)


def _evict(settings: CacheSettings, entry: Entry) -> None:
    """After a fetch into ``entry``: the least recently used copies removed down to the size bound (evict.py)."""
    if settings.max_bytes is not None:
        evict(settings.root, settings.max_bytes, keep=entry.dir)
