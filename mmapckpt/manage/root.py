"""A managed root: its marker, its step directories, and what is stored under it.

A root is a local directory or an object-store prefix (``s3://``, ``az://``, ``gs://``) laid out as
docs/manager.md says:

- ``ROOT/.mmapckpt-root``: the marker, JSON ``{"format": "mmapckpt-root", "version": 1}``, written
  by the manager before its first step; readers allow cross-step references only under it;
- ``ROOT/step-{N}/``: step N, an ordinary mmapckpt checkpoint, committed when its ``.metadata`` is;
- ``ROOT/.leases/``: one small file per load in progress (``leases.py``).

Every file is read and written through the storage seam (``storage_for``), listing what is below
the root included (``CheckpointStorage.files_below``, ``unfinished_below``: one listing of an object
store, whichever); a local root's directories are read here. A new storage object is made for every question asked of the store, so that nothing another process changed
is answered from a cache.
"""

from __future__ import annotations

import json
import os
import posixpath
import re
from collections.abc import Mapping
from typing import Any

from ..errors import CheckpointError, FormatError, UnsupportedVersionError
from ..format.metadata import METADATA_NAME
from ..storage.base import CheckpointStorage
from ..storage.local import LocalStorage
from ..storage.location import is_url, storage_for

__all__ = ["Root", "MARKER", "LEASES", "step_dir", "step_of", "root_relative"]

MARKER = ".mmapckpt-root"
LEASES = ".leases"
_MARKER_DOC = {"format": "mmapckpt-root", "version": 1}
_STEP = re.compile(r"step-(0|[1-9][0-9]*)\Z")


def step_dir(step: int) -> str:
    """The directory of step ``step`` relative to the root: ``step-{N}`` (decimal, no padding)."""
    return f"step-{step}"


def step_of(name: str) -> int | None:
    """The step a root entry ``step-{N}`` is, or None for any other name."""
    m = _STEP.match(name)
    return int(m.group(1)) if m else None


class Root:
    """The root at ``location`` (a directory path or a URL), its storage options kept for every location under it."""

    def __init__(self, location: str | os.PathLike[str], options: Mapping[str, Any] | None = None) -> None:
        s = os.fspath(location)
        self.location = s.rstrip("/") if is_url(s) else s
        self.options = dict(options or {})
        self.storage()  # a URL of no medium, or bad storage_options, is refused here

    # ------------------------------------------------------------------ naming
    def join(self, name: str) -> str:
        """The path or URL of ``name`` (root-relative, ``/``-separated) under the root."""
        if is_url(self.location):
            return f"{self.location}/{name}"
        return os.path.join(self.location, *name.split("/"))

    def storage(self, name: str = "") -> CheckpointStorage:
        """A fresh storage of the root (``name`` "") or of the location ``name`` under it."""
        return storage_for(self.join(name) if name else self.location, options=self.options)

    def step_storage(self, step: int) -> CheckpointStorage:
        return self.storage(step_dir(step))

    # ------------------------------------------------------------------ the marker
    def check(self) -> bool:
        """Whether the root is marked; CheckpointError where the location cannot be a root."""
        storage = self.storage()
        if isinstance(storage, LocalStorage) and os.path.exists(self.location) and not os.path.isdir(self.location):
            raise CheckpointError("a checkpoint root must be a directory, and this is a file: pass the directory "
                                  "the steps go into", path=self.location)
        if storage.exists(MARKER):
            self._check_marker(storage.read_file(MARKER, 4096), storage.full(MARKER))
            return True
        if storage.exists(METADATA_NAME):
            raise CheckpointError("this is a checkpoint, not a root of managed steps: give CheckpointManager a "
                                  "directory of its own (each step becomes ROOT/step-N), or load this checkpoint "
                                  "with mmapckpt.load / MmapReader", path=self.location)
        return False

    @staticmethod
    def _check_marker(data: bytes | bytearray, where: str) -> None:
        try:
            doc = json.loads(bytes(data).decode())
        except (UnicodeDecodeError, ValueError):
            doc = None
        if not isinstance(doc, dict) or doc.get("format") != _MARKER_DOC["format"]:
            raise FormatError(f"not a root marker (expected JSON {json.dumps(_MARKER_DOC)}): remove it if "
                              "nothing else wrote it", path=where)
        if doc.get("version") != _MARKER_DOC["version"]:
            raise UnsupportedVersionError(f"root layout version {doc.get('version')!r}; this mmapckpt knows "
                                          f"version {_MARKER_DOC['version']}: upgrade mmapckpt", path=where)

    def mark(self) -> None:
        """Write the marker (once, before the first step)."""
        storage = self.storage()
        if storage.exists(MARKER):
            return
        storage.prepare()
        storage.commit(MARKER, json.dumps(_MARKER_DOC).encode(), sync=True)

    # ------------------------------------------------------------------ what is there
    def objects(self) -> dict[str, int]:
        """Every file in a step directory, root-relative (``step-3/__0_0.distcp``), with its size in bytes."""
        if is_url(self.location):
            return self._keys()
        out: dict[str, int] = {}
        try:
            names = os.listdir(self.location)
        except FileNotFoundError:
            return out
        except OSError as e:
            raise CheckpointError(f"cannot list the root: {e.strerror or e}", path=self.location) from None
        for name in names:
            if step_of(name) is None:
                continue
            try:
                with os.scandir(os.path.join(self.location, name)) as it:
                    for entry in it:
                        if entry.is_file(follow_symlinks=False):
                            out[f"{name}/{entry.name}"] = entry.stat(follow_symlinks=False).st_size
            except (NotADirectoryError, FileNotFoundError):
                continue
        return out

    def _keys(self) -> dict[str, int]:
        """:meth:`objects` of an object store: one listing of what is below the root (``files_below``)."""
        return {name: size for name, size in self.storage().files_below().items()
                if step_of(name.partition("/")[0]) is not None}

    def step_dirs(self, objects: Mapping[str, int] | None = None, *, uploads: bool = False) -> dict[int, bool]:
        """Every step that has a directory (or objects), and whether it is committed (holds ``.metadata``).
        ``uploads``: on an object store, also the steps that hold only uploads in progress (a killed save's)."""
        objects = self.objects() if objects is None else objects
        out: dict[int, bool] = {}
        for name in [*objects, *(self._uploads() if uploads and is_url(self.location) else ())]:
            top, _, rest = name.partition("/")
            step = step_of(top)
            if step is not None:
                out[step] = out.get(step, False) or rest == METADATA_NAME
        if not is_url(self.location):  # an empty local step directory (a save killed before its first file)
            for name in _listdir(self.location):
                step = step_of(name)
                if step is not None and step not in out and os.path.isdir(os.path.join(self.location, name)):
                    out[step] = False
        return out

    def _uploads(self) -> list[str]:
        """The root-relative names of the writes in progress in step directories that are no files (an object
        store's uploads a killed save left: ``unfinished_below``)."""
        return self.storage().unfinished_below()

    def remove_dir(self, step: int) -> None:
        """Remove step ``step``'s directory once it is empty (nothing to do on an object store)."""
        if not is_url(self.location):
            try:
                os.rmdir(self.join(step_dir(step)))
            except OSError:
                pass


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def root_relative(step: int, file: str) -> str | None:
    """A storage record's file (relative to step ``step``'s directory) as a root-relative name, or None where it
    leaves the root (dedup's ``../step-M/NAME`` becomes ``step-M/NAME``)."""
    name = posixpath.normpath(posixpath.join(step_dir(step), file.replace("\\", "/")))
    return None if name.startswith("../") or name == ".." or name.startswith("/") else name
