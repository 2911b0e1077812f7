"""A conversion's destination, local or at a URL: the new checkpoint written through its medium's storage.

One write path for every output format and every medium: :func:`write_to` asks the storage for
a new version of the destination (``CheckpointStorage.replacement``, storage/replacement.py),
writes the format's files into it with the sinks (each data file through ``create_file``, a
``FileOutput`` that appears under its name only once complete; a directory's commit, its
``.metadata`` or index, last, through ``commit``), and then commits the new version:

- on a local disk the new version is written beside the destination and swapped in (old or
  new at every instant; an old directory keeps every file that is not its checkpoint's; an
  interrupted swap is finished or undone by the next conversion: storage/local.py ``Swap``);
- at a URL (an object store has no rename) it is written in place under names no file there has,
  and the old checkpoint's files that the new one does not use are removed only after the new
  commit (outputs.py ``owned_files``: never files of other names, such as config.json);
  ``model.safetensors`` alone is replaced whole, as a file is.

A failure aborts what was being written, removes what the conversion wrote, and becomes one
CheckpointWriteError naming the destination, what the medium said and what became of the
destination. A URL names a directory where files exist under it and a file where it is one
(reading/located.py); a file output into a directory, or a directory output onto a file, is
refused there (name another destination).
"""

from __future__ import annotations

import errno
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import CheckpointError, CheckpointExistsError, CheckpointWriteError
from .progress import Progress
from ..reading.located import split_url
from ..storage.base import CheckpointStorage, Lock
from ..storage.location import storage_for
from ..storage.replacement import Replacement
from ..reading.formats import family
from .common import SinkJob, Source
from .outputs import owned_files

__all__ = ["Destination", "url_destination", "local_destination", "writes_directory", "write_to", "same_location",
           "example_file"]


@dataclass
class Destination:
    """Where a conversion writes.

    Attributes:
        storage: the destination as a location (what a directory output replaces).
        parent: the storage holding the destination as file ``name`` (a file output); None where there is none.
        name: the destination's name in ``parent``.
        target: the destination's full name, for messages.
        as_dir: whether the output is a directory (mmapckpt, dcp, Hugging Face shards, safetensors into a directory).
        existed: whether something was there before.
        lock: the destination's lock, held by the caller (released by :meth:`release`).
    """

    storage: CheckpointStorage
    parent: CheckpointStorage | None
    name: str
    target: str
    as_dir: bool
    existed: bool
    lock: Lock | None = None

    def release(self) -> None:
        lock, self.lock = self.lock, None
        if lock is not None:
            lock.release()


def writes_directory(storage: CheckpointStorage, to: str, limit: int | None) -> bool:
    """Whether format ``to`` is written at ``storage`` as a directory (the format table's record says:
    mmapckpt, dcp and sharded safetensors are directories; so is safetensors into an existing directory)."""
    f = family(to)
    return f.directory or (f.shards and limit is not None) or (f.dir_file is not None and storage.is_location())


def same_location(src: str, dst: str) -> bool:
    """Whether URL ``dst`` is URL ``src`` or a directory holding it (the destination would replace the source)."""
    s, d = src.rstrip("/"), dst.rstrip("/")
    return s == d or s.startswith(d + "/")


def local_destination(target: str, to: str, limit: int | None) -> Destination:
    """The local path ``target`` (its links already followed: what is replaced) as a destination."""
    storage = storage_for(target, error=CheckpointWriteError)
    parent, name = os.path.split(os.path.abspath(target))
    return Destination(storage, storage_for(parent, error=CheckpointWriteError), name, target,
                       writes_directory(storage, to, limit), os.path.lexists(target))


def url_destination(dst: str, to: str, limit: int | None, overwrite: bool,
                    options: Mapping[str, Any] | None) -> Destination:
    """The URL ``dst`` as a destination, checked, and locked where the output is a directory.

    Raises:
        CheckpointExistsError: ``dst`` exists and ``overwrite`` is not set, or it is a directory where the output
            is a file (or the other way round).
        CheckpointWriteError: another save or conversion holds the location's lock.
    """
    storage = storage_for(dst, error=CheckpointWriteError, options=options)
    parent_url, name = split_url(dst)
    parent = storage_for(parent_url, error=CheckpointWriteError, options=options) if name else None
    is_dir = storage.is_location()
    is_file = not is_dir and parent is not None and parent.exists(name)
    if (is_dir or is_file) and not overwrite:
        raise CheckpointExistsError("destination exists; pass overwrite=True (--overwrite) to replace it", path=dst)
    as_dir = writes_directory(storage, to, limit)
    if as_dir and is_file:
        raise CheckpointExistsError(f"destination is a file, and a {to} checkpoint here is a directory: remove it "
                                    "or name another destination", path=dst)
    if not as_dir and (is_dir or parent is None):
        what = "destination is a directory (files exist under it)" if is_dir else "destination names no file"
        raise CheckpointExistsError(f"{what}, and a {to} checkpoint is one file: name a file, e.g. "
                                    f"{dst.rstrip('/')}/{example_file(to)}", path=dst)
    dest = Destination(storage, parent, name, dst, as_dir, is_dir or is_file)
    if as_dir:
        storage.prepare()
        dest.lock = storage.lock()  # CheckpointWriteError as it is: another save or conversion holds it
    else:
        parent.prepare()  # type: ignore[union-attr]
    return dest


def write_to(dest: Destination, source: Source, to: str, limit: int | None, checkpoint_id: str, overwrite: bool,
             bar: Progress, user: dict[str, str] | None) -> tuple[list[str], list[str]]:
    """Write ``source`` in format ``to`` as a new version of ``dest`` and commit it (see the module docstring).

    Returns the entries left out and the hidden names where entries of an old directory that could be neither
    kept nor removed were put (the caller warns).

    Raises:
        CheckpointExistsError: the destination appeared meanwhile (without ``overwrite``).
        CheckpointWriteError: writing failed (the destination is named, and what became of it).
    """
    with bar:  # a failure or Ctrl-C ends the bar's line where it was (Progress.abandon)
        repl: Replacement | None = None
        try:
            owned = lambda: owned_files(dest.storage)  # noqa: E731 - what an old directory there owns
            if dest.as_dir:
                repl = dest.storage.replacement(owned=owned, overwrite=overwrite)
            else:  # a file, maybe over a directory that holds only a checkpoint
                repl = dest.parent.replacement(dest.name, owned=owned, overwrite=overwrite)  # type: ignore[union-attr]
            fmt = family(to)
            if not fmt.scratch:  # a sink through a scratch file names its own two phases
                bar.phase("write", bar.total)
            name = repl.name if not dest.as_dir else (fmt.dir_file or repl.name)  # a file into a directory: HF's name
            sink = fmt.resolved("sink")  # every sink: (source, out, job) -> (left out, commit)
            dropped, commit = sink(source, repl, SinkJob(name, dest.as_dir, limit, checkpoint_id, bar, user))
            bar.phase("commit")
            kept = repl.commit(commit)
        except OSError as e:  # CheckpointError is an OSError too (a source file gone, ...)
            _abort(repl)
            failed = _failed(e, repl, dest)
            if failed is e:
                raise
            raise failed from e
        except BaseException:
            _abort(repl)
            raise
        finally:
            if repl is not None:
                repl.close()
    return dropped, kept


def _abort(repl: Replacement | None) -> None:
    if repl is not None:
        repl.abort()


def example_file(to: str) -> str:
    """A file name of format ``to``, for messages (``model.safetensors``, ``model.pt``)."""
    return "model" + family(to).extensions[0]


def _failed(e: OSError, repl: Replacement | None, dest: Destination) -> OSError:
    """A failed write as the user should see it: which file of the new version, what the medium said, and what
    became of the destination; other errors (a damaged source, a destination that appeared) as they are."""
    if isinstance(e, CheckpointError) and not isinstance(e, CheckpointWriteError):
        return e
    where = e.path if isinstance(e, CheckpointError) else e.filename
    reason = (e.message.removeprefix("writing failed: ").removeprefix("writing shard failed: ")  # the sinks' words
              if isinstance(e, CheckpointError) else str(e))
    what = ""
    if repl is not None and isinstance(where, str):
        root = repl.storage.full("")
        if where.startswith(root) and where != repl.storage.full(repl.name):
            what = f" writing {where[len(root):]}"
    cause = e.__cause__ if isinstance(e, CheckpointError) else e
    state = "was left as it was" if dest.existed else "was not created"
    if getattr(cause, "errno", None) in (errno.ENOSPC, errno.EDQUOT):
        state += " (the new checkpoint is written beside it before it is replaced: free room for both)"
    return CheckpointWriteError(f"conversion failed{what}: {reason}; {dest.target} {state}", path=dest.target,
                                entry=e.entry if isinstance(e, CheckpointError) else None)
