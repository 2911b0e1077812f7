"""A location's listing, kept beside its commit's copy: a warm load asks the store one HEAD instead of a LIST.

A load through the cache needs the version of every file it opens (storage.py): one listing of the location
gives them all (S3: one LIST). A listing's response carries a body, and a LIST costs the store more than a HEAD
(measured on radosgw: 10-45 ms against 1.5-2 ms, docs/object-storage.md "The local cache"). So where the
location's commit is an mmapckpt ``.metadata``, the listing is recorded (``#listing`` in the commit's cache
entry) together with the commit's version, and a later load that finds the commit at that version (one HEAD)
takes the listing from the record. A medium without a listing of versions (no ``versions()``: each file's
version is found by one look at it, Azure and GCS today) records the versions it found file by file the same
way, so that its warm loads look at ``.metadata`` only.

Why the commit's version vouches for the listing: an mmapckpt commit names a save id, random per save, that
every shard it references carries in its header (readers check it: reading/shard.py); a save writes its shards
under names no committed file has (storage/commits.py ``shard_name``) and commits last, and removes files only
once no commit references them. So while ``.metadata`` is the version recorded, the files it references are the
ones listed with it. Other commits (stock DCP ``.metadata``: the same bytes for two saves of one model, its shards
overwritten in place) and locations without a commit are listed at every load, as before.
"""

from __future__ import annotations

import json
import os
from typing import Any

from ...format.metadata import METADATA_NAME, metadata_kind
from ...io.files import atomic_write
from .entry import Entry

__all__ = ["LISTING", "Seen", "is_mmapckpt", "recorded_listing", "record_listing"]

LISTING = "#listing"


def _path(root: str, url: str) -> str:
    """The record's path: in the cache entry of the location's commit ``url`` (its full name)."""
    return os.path.join(Entry(root, url).dir, LISTING)


def recorded_listing(root: str, url: str, commit: list[Any]) -> dict[str, Any] | None:
    """``{name: (size, ident)}`` recorded with the commit ``url`` at version ``commit`` (:func:`~.entry.ident_of`),
    or None where none was (another version, another location, no record, a damaged one)."""
    path = _path(root, url)
    try:
        with open(path, "rb") as f:
            rec = json.loads(f.read())
    except (OSError, ValueError):
        return None
    if not isinstance(rec, dict) or rec.get("url") != url or rec.get("commit") != commit:
        return None
    files = rec.get("files")
    if not isinstance(files, dict) or not all(isinstance(v, list) and len(v) == 2 for v in files.values()):
        return None
    return {n: tuple(v) for n, v in files.items()}


def is_mmapckpt(head: bytes) -> bool:
    """Whether a commit whose first bytes are ``head`` is an mmapckpt one (its listing may be recorded)."""
    return metadata_kind(head) == "mmapckpt"


def record_listing(root: str, url: str, commit: list[Any], files: dict[str, Any]) -> None:
    """Record ``files`` (``{name: (size, ident)}`` found while the commit ``url``, an mmapckpt one, was at version
    ``commit``); a record that cannot be written is skipped (the next load looks again)."""
    path = _path(root, url)
    rec = {"url": url, "commit": commit, "files": {n: list(v) for n, v in files.items()}}
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        atomic_write(path, json.dumps(rec, default=str).encode(), sync=False)
    except OSError:
        pass


class Seen:
    """A medium without a listing of versions, as one load finds its files: the versions found one by one, recorded
    with the location's commit (full name ``url``) once it is known to be an mmapckpt commit at version
    :attr:`commit`; a later load that finds the commit at that version takes them from the record."""

    def __init__(self, root: str, url: str) -> None:
        self.root, self.url = root, url
        self.files: dict[str, Any] | None = None  # None: the record not read yet
        #: the commit's version the files are recorded with (None: not known to be an mmapckpt commit yet)
        self.commit: list[Any] | None = None
        self._had = False

    def take(self, commit: list[Any]) -> bool:
        """Read the files recorded with the commit at version ``commit`` (once); whether there was a record (which
        exists only for an mmapckpt commit: then the files found next are added to it)."""
        if self.files is None:
            recorded = recorded_listing(self.root, self.url, commit)
            self.files, self._had = dict(recorded or {}), recorded is not None
        if self._had:
            self.commit = commit
        return self._had

    def vouched(self, commit: list[Any]) -> None:
        """The commit at version ``commit`` is an mmapckpt one: record what was found (once), and what is next."""
        if not self.take(commit):
            record_listing(self.root, self.url, commit, self.files or {})
            self._had, self.commit = True, commit

    def found(self, name: str, found: Any) -> None:
        """File ``name`` found at ``found`` (``(size, ident)``): recorded where the commit is vouched for."""
        if self.files is not None and self.commit is not None:
            self.files[name] = found
            record_listing(self.root, self.url, self.commit, self.files)
