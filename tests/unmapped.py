"""A medium without mappings for the tests: ``unmapped://DIR`` serves a local directory as an object store would.

``Unmapped`` is a second implementation of ``storage/base.py``'s ``CheckpointStorage``: its
files have no mapping (as on an object store), so every byte must come through
``StoredFile.read_into``, which it counts (``Unmapped.counter``, by every instance). It writes as
a local directory does (it subclasses ``LocalStorage``), with pieces held to ascending offsets
after the head, as an object store's upload takes them. ``medium`` registers the scheme for a
test and yields the counter; ``opened`` counts the files opened through it.
"""

from __future__ import annotations

from typing import Any

import pytest

from mmapckpt.storage import local, location
from mmapckpt.storage.base import CheckpointStorage, FileOutput, StoredFile

SCHEME = "unmapped"


class _UnmappedFile(StoredFile):
    """A file of the medium: read by range only, every byte counted."""

    def __init__(self, inner: local.LocalFile, counter: list[int]) -> None:
        self.inner, self.counter = inner, counter
        self.path, self.size, self.ident = f"{SCHEME}://" + inner.path, inner.size, inner.ident

    def read_into(self, offset: int, buf: Any, *, entry: str | None = None) -> None:
        self.inner.read_into(offset, buf, entry=entry)
        self.counter[0] += memoryview(buf).nbytes
        Unmapped.reads.append((self.path, offset, memoryview(buf).nbytes))

    def close(self) -> None:
        self.inner.close()


class _AscendingOutput(FileOutput):
    """A file being written, held to what an object store's upload needs: pieces at ascending offsets, after
    the head."""

    def __init__(self, inner: FileOutput, head: int) -> None:
        self.inner, self.path, self.how, self.end = inner, f"{SCHEME}://" + inner.path, inner.how, head

    def put(self, offset: int, data: Any) -> None:
        if offset < self.end:
            raise ValueError(f"piece at {offset} before the end of the previous one ({self.end})")
        self.end = offset + memoryview(data).nbytes
        self.inner.put(offset, data)

    def finish(self, head: bytes) -> None:
        self.inner.finish(head)

    def abort(self) -> None:
        self.inner.abort()


class Unmapped(local.LocalStorage):
    """A local directory served as a medium without mappings (``can_map`` False)."""

    can_map = False
    #: bytes read through the seam, by every instance (one per reader)
    counter = [0]
    #: (file, offset, length) of every read through the seam
    reads: list[tuple[str, int, int]] = []
    #: the options each instance was made with
    options: list[Any] = []

    # A conversion writes into it in place, as into an object store (no rename: storage/replacement.py InPlace).
    replacement = CheckpointStorage.replacement
    recover = CheckpointStorage.recover

    def __init__(self, url: str, options: Any = None) -> None:
        super().__init__(url.split("://", 1)[1])
        Unmapped.options.append(options)

    def full(self, name: str) -> str:
        return f"{SCHEME}://" + super().full(name)

    def open_file(self, name: str) -> StoredFile:  # type: ignore[override]
        return _UnmappedFile(super().open_file(name), self.counter)

    def create_file(self, name: str, size: int | None, *, head: int, direct: bool, sync: bool) -> FileOutput:
        return _AscendingOutput(super().create_file(name, size, head=head, direct=direct, sync=sync), head)


def url(path: Any) -> str:
    """The medium's URL of a local path."""
    return f"{SCHEME}://{path}"


@pytest.fixture
def medium():
    """The scheme registered for the test; yields the byte counter (reset)."""
    location.register_scheme(SCHEME, Unmapped)
    Unmapped.counter[0] = 0
    Unmapped.reads.clear()
    Unmapped.options.clear()
    try:
        yield Unmapped.counter
    finally:
        location.register_scheme(SCHEME, None)
