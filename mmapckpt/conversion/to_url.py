"""A conversion's destination at a URL: the new checkpoint written through the storage of its medium.

A local destination is written beside itself and swapped in (driver.py, io/replace.py). An
object store has no rename, so a destination at a URL (``scheme://...``, a medium registered
with ``storage/location.py``) is written in place, with the same guarantees where the medium
gives them:

- every data file (a shard, a safetensors file) goes through ``create_file`` and appears under
  its name only once complete (``FileOutput.finish``: a multipart upload completed); a
  ``torch.save`` file is written to a local temporary file first (in the system's temporary
  directory: torch.save needs a seekable file), then copied through the same ``FileOutput``;
- a directory output's commit (``.metadata``, the safetensors index) is written last, through
  ``commit``; its data files take names no file there has (outputs.py ``fresh_name``: an mmapckpt
  or DCP shard, a Hugging Face shard whose usual name an old checkpoint's file has, gets a tag in
  its name, which its commit records), so an old checkpoint stays whole until the new commit
  replaces its own: old or new at every instant. Only then are the old checkpoint's files that
  the new one does not use removed (outputs.py ``checkpoint_files``: never files of other names,
  such as config.json). ``model.safetensors`` alone is replaced whole, as a file is;
- a failed conversion aborts the file being written and removes the files it finished; it
  removes nothing it did not write. A destination that exists is replaced only with
  ``overwrite=True``; a directory output takes the location's lock (``storage.lock()``), as a
  save does.

A URL names a directory where files exist under it and a file where it is one
(reading/located.py); a file output into a directory, or a directory output onto a file, is
refused (name another destination).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from typing import Any

from ..errors import CheckpointError, CheckpointExistsError, CheckpointWriteError
from .progress import Progress
from ..reading.located import split_url
from ..storage.base import CheckpointStorage, FileOutput
from ..storage.location import storage_for
from ..format.metadata import METADATA_NAME
from .common import SAFETENSORS_INDEX, SAFETENSORS_SINGLE, Source, Writing
from .flat_sinks import write_safetensors, write_torch
from .outputs import checkpoint_files, is_commit_file, write_stored
from .sinks import write_dcp, write_mmapckpt

__all__ = ["convert_to_url", "same_location"]

#: The largest index read to learn which files an old checkpoint owns.
_MAX_INDEX = 64 << 20
#: Bytes of a local torch.save file copied per piece into the storage.
_PIECE = 8 << 20


def same_location(src: str, dst: str) -> bool:
    """Whether URL ``dst`` is URL ``src`` or a directory holding it (the destination would replace the source)."""
    s, d = src.rstrip("/"), dst.rstrip("/")
    return s == d or s.startswith(d + "/")


def convert_to_url(source: Source, dst: str, to: str, limit: int | None, overwrite: bool, bar: Progress,
                   user: dict[str, str] | None, options: Mapping[str, Any] | None) -> list[str]:
    """Write ``source`` in format ``to`` at the URL ``dst`` (see the module docstring); return the entries left out.

    Raises:
        CheckpointExistsError: ``dst`` exists and ``overwrite`` is not set, or it is a directory where the output
            is a file (or the other way round).
        CheckpointWriteError: writing failed (``dst`` is named, and what became of it).
    """
    storage = storage_for(dst, error=CheckpointWriteError, options=options)
    parent_url, name = split_url(dst)
    parent = storage_for(parent_url, error=CheckpointWriteError, options=options) if name else None
    is_dir = storage.is_location()
    is_file = not is_dir and parent is not None and parent.exists(name)
    if (is_dir or is_file) and not overwrite:
        raise CheckpointExistsError("destination exists; pass overwrite=True (--overwrite) to replace it", path=dst)
    as_dir = to in ("mmapckpt", "dcp") or (to == "safetensors" and (limit is not None or is_dir))
    if as_dir and is_file:
        raise CheckpointExistsError(f"destination is a file, and a {to} checkpoint here is a directory: remove it "
                                    "or name another destination", path=dst)
    if not as_dir and (is_dir or parent is None):
        ext = "safetensors" if to == "safetensors" else "pt"
        what = "destination is a directory (files exist under it)" if is_dir else "destination names no file"
        raise CheckpointExistsError(f"{what}, and a {to} checkpoint is one file: name a file, e.g. "
                                    f"{dst.rstrip('/')}/model.{ext}", path=dst)
    lock = None
    if as_dir:
        storage.prepare()
        lock = storage.lock()  # CheckpointWriteError as it is: another save or conversion holds it
    try:
        if as_dir:
            return _into_directory(storage, source, dst, to, limit, bar, user)
        return _into_file(parent, name, source, to, bar, user)  # type: ignore[arg-type]
    except OSError as e:  # CheckpointError is an OSError too
        failed = _failed(e, dst, is_dir or is_file)
        if failed is e:
            raise
        raise failed from e
    finally:
        if lock is not None:
            lock.release()


def _failed(e: OSError, dst: str, existed: bool) -> OSError:
    """A failed write as the user should see it: the destination, what the medium said, and what became of it;
    other errors (a damaged source) as they are."""
    if isinstance(e, CheckpointError) and not isinstance(e, CheckpointWriteError):
        return e
    reason = e.message if isinstance(e, CheckpointError) else str(e)
    reason = reason.removeprefix("writing failed: ").removeprefix("writing shard failed: ")
    where = e.path if isinstance(e, CheckpointError) else e.filename
    what = f" writing {where}" if isinstance(where, str) and where != dst else ""
    state = "was left as it was" if existed else "was not created"
    return CheckpointWriteError(f"conversion failed{what}: {reason}; {dst} {state}", path=dst,
                                entry=e.entry if isinstance(e, CheckpointError) else None)


def _into_directory(storage: CheckpointStorage, source: Source, dst: str, to: str, limit: int | None,
                    bar: Progress, user: dict[str, str] | None) -> list[str]:
    before = set(storage.list())
    old = checkpoint_files(before, lambda n: bytes(storage.read_file(n, _MAX_INDEX)))
    created: list[str] = []  # data files finished (the commit is not one: a failed commit leaves the old one)
    try:
        with bar:
            dropped, commit = _write_directory(storage, source, dst, to, limit, bar, user, before, created)
    except BaseException:
        storage.remove(created, sync=True)  # the files it finished; the one being written was aborted
        raise
    stale = old - set(created) - {commit}
    storage.remove(sorted(n for n in stale if is_commit_file(n)), sync=False)  # no commit names them any more
    storage.remove(sorted(n for n in stale if not is_commit_file(n)), sync=True)
    return dropped


def _write_directory(storage: CheckpointStorage, source: Source, dst: str, to: str, limit: int | None,
                     bar: Progress, user: dict[str, str] | None, before: set[str],
                     created: list[str]) -> tuple[list[str], str]:
    """Write the files, then the commit; return the entries left out and the commit's name."""
    if to == "mmapckpt":
        write_mmapckpt(source, storage, checkpoint_id=dst, progress=bar, user_metadata=user, avoid=before,
                       created=created)
        return [], METADATA_NAME
    if to == "dcp":
        write_dcp(source, storage, checkpoint_id=dst, progress=bar, avoid=before, created=created)
        return [], METADATA_NAME
    if limit is None:  # model.safetensors: replaced whole (an old index, if any, still wins until removed)
        return write_safetensors(source, storage, max_shard_size=None, progress=bar, user_metadata=user,
                                 name=SAFETENSORS_SINGLE, created=created), SAFETENSORS_SINGLE
    return write_safetensors(source, storage, max_shard_size=limit, progress=bar, user_metadata=user, avoid=before,
                             created=created), SAFETENSORS_INDEX


def _into_file(parent: CheckpointStorage, name: str, source: Source, to: str, bar: Progress,
               user: dict[str, str] | None) -> list[str]:
    parent.prepare()
    with bar:
        if to == "safetensors":
            return write_safetensors(source, parent, max_shard_size=None, progress=bar, user_metadata=user, name=name)
        with tempfile.TemporaryDirectory(prefix="mmapckpt-convert-") as d:
            local = os.path.join(d, "out.pt")
            dropped = write_torch(source, local, progress=bar)
            _copy_in(local, parent, name)
    return dropped


def _copy_in(local: str, storage: CheckpointStorage, name: str) -> None:
    """The local file ``local`` as file ``name`` of ``storage``, in pieces, through a ``FileOutput``."""
    size = os.path.getsize(local)

    def body(out: FileOutput, w: Writing) -> bytes:
        with open(local, "rb") as f:
            pos = 0
            while piece := f.read(_PIECE):
                out.put(pos, piece)
                pos += len(piece)
        return b""

    write_stored(storage, name, size, 0, body)
