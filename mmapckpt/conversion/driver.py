"""Conversions between checkpoint formats: mmapckpt, stock DCP, safetensors, torch.save.

``convert(src, dst, to=...)`` reads the source one item at a time and streams it
into a writer for the target format (sinks.py, flat_sinks.py), through the storage of
``dst``'s medium as a new version that replaces ``dst`` only when complete
(destination.py): ``dst`` holds the old or the new checkpoint at every instant, and an old
directory's files that are not its checkpoint's (see :func:`previous_checkpoint_files`) are kept.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from dataclasses import dataclass
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ..errors import CheckpointError, CheckpointExistsError, CheckpointWriteError
from .progress import Progress, ProgressCallback
from ..io.sizes import parse_size
from ..storage.base import CheckpointStorage, Lock
from .cast import CastSource, cast_dtype
from ..reading.formats import family, target_family
from .common import FORMATS, SelectedSource, Source, select_names
from ..storage.location import is_url, storage_for
from .detect import open_source
from .destination import (Destination, example_file, local_destination, same_location, url_destination, write_to,
                          writes_directory)
from .outputs import owned_files

__all__ = ["convert", "ConvertResult", "ConversionWarning", "parse_size", "previous_checkpoint_files", "FORMATS",
           "target_format"]


class ConversionWarning(UserWarning):
    """Something in the source could not be carried into the target format (it is named)."""


@dataclass(frozen=True)
class ConvertResult:
    """What a conversion did.

    Attributes:
        source_format: the format read, from FORMATS.
        target_format: the format written, from FORMATS.
        path: the written checkpoint (``dst``).
        tensors: tensors written.
        tensor_bytes: bytes of tensor data written.
        dropped: non-tensor entries left out (see the warning).
    """

    source_format: str
    target_format: str
    path: str
    tensors: int
    tensor_bytes: int
    dropped: tuple[str, ...]


def target_format(dst: str | os.PathLike[str]) -> str:
    """The format ``convert`` writes at ``dst`` when ``to`` is not given: ``.safetensors`` -> safetensors,
    ``.pt``, ``.pth``, ``.bin`` -> torch, anything else (a directory) -> mmapckpt.

    Example:
        >>> target_format("model.safetensors"), target_format("out/model.bin"), target_format("ckpt")
        ('safetensors', 'torch', 'mmapckpt')
    """
    return target_family(dst)  # the format table's extensions (reading/formats.py)


def sharded_formats() -> list[str]:
    """The formats that take ``max_shard_size``."""
    return [f for f in FORMATS if family(f).shards]


def _check_paths(src: str, dst: str, target: str, overwrite: bool, options: Mapping[str, Any] | None) -> None:
    if is_url(src):
        storage_for(src, options=options)  # a URL of no registered medium is refused (CheckpointNotFoundError)
    elif _inside(os.path.realpath(src), os.path.realpath(dst)):
        raise CheckpointError("the destination would replace the source; choose another destination", path=dst)
    if os.path.lexists(dst) and not overwrite:
        raise CheckpointExistsError("destination exists; pass overwrite=True (--overwrite) to replace it", path=dst)
    if os.path.islink(dst) and not os.path.lexists(target):
        raise CheckpointWriteError(f"the destination is a symbolic link to {target}, which does not exist: create "
                                   "it, or remove the link (convert writes through a link, never replaces it)",
                                   path=dst)
    parent = os.path.dirname(os.path.abspath(target))
    if not os.path.isdir(parent):
        raise CheckpointError("the destination's parent directory does not exist", path=parent)


def _inside(src: str, dst: str) -> bool:
    return src == dst or src.startswith(dst + os.sep)


def _through_link(path: str) -> str:
    """``path``, or, where it is a symbolic link, the path it finally names: that is what is replaced."""
    return os.path.realpath(path) if os.path.islink(path) else path


@contextlib.contextmanager
def _locks() -> Iterator[Any]:
    """``lock(storage)`` takes the lock of the destination ``storage`` (``storage.lock()``, as a save takes it)
    where it is a location, until the block ends; a location is locked once.

    A conversion holds it on the directory it replaces (and, storage/local.py ``Swap``, on the
    new one it swaps in), so that no save commits into either while the conversion writes and
    replaces; a save or conversion already holding it makes ``lock`` raise CheckpointWriteError.
    """
    held: dict[str, Lock] = {}

    def lock(storage: CheckpointStorage) -> None:
        if storage.location not in held and storage.is_location():
            held[storage.location] = storage.lock()

    try:
        yield lock
    finally:
        for h in held.values():
            h.release()


def previous_checkpoint_files(directory: str) -> set[str]:
    """The names in ``directory`` that belong to a checkpoint there, which ``convert --overwrite`` replaces.

    DCP (mmapckpt or stock): ``.metadata``, ``__*.metadata``, ``__*_*.distcp`` and their writers'
    temp files. Hugging Face safetensors: every ``*.safetensors.index.json``, the files their
    ``weight_map`` names, ``model.safetensors`` and ``model-NNNNN-of-NNNNN.safetensors`` (or
    ``model-NNNNN-of-NNNNN.TAG.safetensors``, as a conversion at a URL names a shard whose name is
    taken). Everything else (config.json, tokenizers, notes, other ``*.safetensors`` such as
    adapters, subdirectories) is not the checkpoint's.
    """
    return owned_files(storage_for(directory))


def _check_replaceable(dst: str, to: str, limit: int | None) -> None:
    """A file output may not replace a directory that holds files of no checkpoint."""
    if writes_directory(storage_for(dst), to, limit):
        return
    if os.path.isdir(dst) and not os.path.islink(dst):
        foreign = sorted(set(os.listdir(dst)) - previous_checkpoint_files(dst))
        if foreign:
            shown = ", ".join(foreign[:5]) + (", ..." if len(foreign) > 5 else "")
            raise CheckpointExistsError(f"destination is a directory holding files that are not a checkpoint's "
                                        f"({shown}); a {to} file would replace them all: name a file, e.g. "
                                        f"{os.path.join(dst, example_file(to))}",
                                        path=dst)


def _recover(storage: CheckpointStorage) -> None:
    """Finish or undo an interrupted replacement of ``storage``'s location, and drop temp files of dead
    conversions (CheckpointWriteError where the medium refuses)."""
    done = storage.recover()
    if done:
        warnings.warn(f"{storage.location}: an interrupted `convert --overwrite` was found: {done}",
                      ConversionWarning, stacklevel=3)


def _warn_kept(kept: list[str], dst: str) -> None:
    if kept:
        warnings.warn(f"{dst}: files that appeared in the old destination during the conversion and could not "
                      f"be placed were kept in {kept[0]}", ConversionWarning, stacklevel=3)


def convert(src: str | os.PathLike[str], dst: str | os.PathLike[str], *, to: str | None = None,
            overwrite: bool = False, max_shard_size: int | str | None = None,
            progress: bool | ProgressCallback = False, keys: Sequence[str] | None = None,
            strip_prefix: str | None = None, exclude: Sequence[str] | None = None, dtype: Any = None,
            storage_options: Mapping[str, Any] | None = None, allow_cast: bool = False) -> ConvertResult:
    """Convert the checkpoint at ``src`` into format ``to`` at ``dst``.

    The source format is detected. DCP <-> mmapckpt keeps the chunk layout, the
    metadata and the non-tensor entries. To safetensors/torch, chunks are assembled
    into full tensors named by their DCP fully-qualified names; safetensors drops
    non-tensor entries (with a ConversionWarning naming them). Memory stays at about
    the largest tensor plus a buffer. User metadata ({str: str}: safetensors'
    ``__metadata__``, ``mmapckpt.save(metadata=)``) is kept where the target can hold it
    (mmapckpt, safetensors); stock DCP and torch.save cannot, and a ConversionWarning says
    it was dropped.

    Either may be a URL of a registered medium (``scheme://...``: storage/location.py), naming a
    directory where files exist under it and a file where it is one. A destination at a URL is
    written through its storage, in place (conversion/destination.py): each data file appears only
    once complete, the commit (``.metadata``, the index) is written last, and the old
    checkpoint's files are removed after it; a ``torch.save`` file goes through a local
    temporary file first.

    Args:
        src: a checkpoint directory (mmapckpt or stock DCP), a ``.safetensors`` file, a Hugging Face
            directory or hub cache snapshot or repository (as :func:`mmapckpt.open` takes them: safetensors
            or ``pytorch_model.bin`` files), or a ``torch.save`` file; or a URL of one.
        dst: where to write; a directory for mmapckpt, dcp and sharded safetensors, else a file
            (safetensors into an existing directory is written there as ``model.safetensors``).
            A symbolic link is kept: what it names is replaced (a dangling link is refused).
            Or a URL: the same, written through the medium's storage. A Hugging Face directory
            converted to a safetensors directory gets the source's ``config.json``,
            ``generation_config.json`` and tokenizer files too (local destinations).
        to: one of ``"mmapckpt"``, ``"dcp"``, ``"safetensors"``, ``"torch"``; None: from ``dst``'s
            extension (:func:`target_format`: ``.safetensors``; ``.pt``, ``.pth``, ``.bin``; else mmapckpt).
        overwrite: replace an existing ``dst``: it holds the old or the new checkpoint at every
            instant, and a directory keeps every file that is not its checkpoint's
            (:func:`previous_checkpoint_files`). An interrupted earlier replacement of ``dst``
            is finished or undone first (a ConversionWarning says which). While it writes and
            replaces, the conversion holds the directory's save lock (as ``MmapWriter`` does).
        max_shard_size: for safetensors only: write HF-style shards of at most this size
            (bytes, or a string such as ``"5GB"``) plus ``model.safetensors.index.json``.
        progress: True draws a progress bar on stderr when it is a terminal (tqdm's, where it is
            installed); a callable is called as ``progress(phase, done, total)`` instead: ``phase``
            names the step (``"write"``; for torch, ``"assemble"`` then ``"torch.save"``; then
            ``"commit"``), ``done`` and ``total`` count bytes over all phases, and the last call has
            ``done == total``.
        keys: convert only the entries whose stored name matches one of these globs
            (``fnmatch``, case-sensitive; ``*`` also matches dots), e.g. ``["model.*"]``.
        exclude: then leave out the entries whose stored name matches one of these globs,
            e.g. ``["*.rotary_emb.inv_freq", "optim.*"]``.
        dtype: cast every float16, bfloat16, float32 and float64 tensor to this dtype (a torch
            dtype or a name: ``"bfloat16"``, ``"bf16"``, ``"fp16"``, ``"float32"``, ...); integer,
            bool, complex and float8 tensors are kept as they are. A finite value outside
            ``dtype``'s range (``1e30`` into float16) raises CastError naming the entry, unless
            ``allow_cast`` (it then becomes inf, as ``Tensor.to`` makes it).
        strip_prefix: then remove this prefix from the selected names that start with it
            (others keep their names), e.g. ``"model."``. Filtering is on the stored name,
            stripping after it; no match, or two names made one by stripping, raises.
        storage_options: for the media of ``src`` and ``dst`` where they are URLs (credentials,
            endpoint, ...: ``storage/location.py`` ``storage_for``); a local path ignores them.
        allow_cast: cast with ``dtype`` even values outside its range.

    Returns:
        A ConvertResult.

    Raises:
        CheckpointError: the source is missing or damaged, the destination exists, a
            tensor cannot be stored in the target format, or ``keys``/``strip_prefix`` select
            nothing or make two names one (all name the file and entry).
        CheckpointWriteError: writing failed (disk full, permissions), or a save or another
            conversion into ``dst`` is in progress (it holds the directory's lock).

    Example:
        >>> convert("ckpt/step100", "model.safetensors", to="safetensors")  # doctest: +SKIP
        >>> convert("ckpt/step100", "hf", to="safetensors", keys=["model.*"], strip_prefix="model.")  # doctest: +SKIP
    """
    to = target_format(dst) if to is None else to
    if to not in FORMATS:
        raise ValueError(f"unknown target format {to!r}; choose one of {', '.join(FORMATS)}")
    shape = _Shaping(keys, exclude, strip_prefix, None if dtype is None else cast_dtype(dtype), progress, allow_cast)
    if max_shard_size is not None and not family(to).shards:
        raise ValueError(f"max_shard_size applies only to {' and '.join(sharded_formats())} output")
    limit = parse_size(max_shard_size) if max_shard_size is not None else None
    src_s, dst_s = os.fspath(src), os.fspath(dst)
    if is_url(dst_s):
        return _convert_to_url(src_s, dst_s, to, limit, overwrite, shape, storage_options)
    dst_s = dst_s.rstrip("/" + os.sep) or dst_s  # "out/" names the entry "out" (its temp sibling is ".out.tmp-*")
    target = _through_link(dst_s)  # a link is kept: what it names is replaced
    storage = storage_for(target, error=CheckpointWriteError)
    with _locks() as lock:
        lock(storage)  # before recovery: a conversion still replacing it keeps its journal
        _recover(storage)
        if not is_url(src_s) and not os.path.exists(src_s):
            _recover(storage_for(_through_link(src_s)))  # a source caught mid-replacement by a killed conversion
        _check_paths(src_s, dst_s, target, overwrite, storage_options)
        _check_replaceable(target, to, limit)
        lock(storage)  # where the recovery put it back
        with open_source(src_s, storage_options=storage_options) as opened:
            source, user, tensors, total, bar = _opened(opened, shape, to)
            dest = local_destination(target, to, limit)
            dropped, kept = write_to(dest, source, to, limit, os.path.abspath(dst_s), overwrite, bar, user)
    _warn_kept(kept, target)
    _warn_lost(dropped, to, user)
    return ConvertResult(source.kind, to, dst_s, len(tensors), total, tuple(dropped))


@dataclass(frozen=True)
class _Shaping:
    """What a conversion does to its source's entries (select, rename, cast), and how it reports progress."""

    keys: Sequence[str] | None
    exclude: Sequence[str] | None
    strip_prefix: str | None
    dtype: Any
    progress: bool | ProgressCallback
    allow_cast: bool = False


def _opened(opened: Source, shape: _Shaping,
            to: str) -> tuple[Source, dict[str, str] | None, list[TensorStorageMetadata], int, Progress]:
    """The source as selected and cast, its user metadata, its tensors, their bytes, and the progress bar."""
    source = _selected(opened, shape.keys, shape.strip_prefix, shape.exclude)
    if shape.dtype is not None:
        source = CastSource(source, shape.dtype, allow_cast=shape.allow_cast)
    tensors = [md for _, md in source.items() if isinstance(md, TensorStorageMetadata)]
    total = sum(md.properties.dtype.itemsize * _numel(md.size) for md in tensors)
    work = 2 * total if family(to).scratch else total  # torch: assembled in a scratch file, then torch.save-d from it
    call = shape.progress if callable(shape.progress) else None
    bar = Progress(work, f"{source.kind} -> {to}", enabled=shape.progress is True, callback=call)
    return source, source.user_metadata(), tensors, total, bar


def _convert_to_url(src: str, dst: str, to: str, limit: int | None, overwrite: bool, shape: _Shaping,
                    options: Mapping[str, Any] | None) -> ConvertResult:
    """:func:`convert` into a destination at a URL (conversion/destination.py)."""
    storage_for(dst, error=CheckpointWriteError, options=options)  # a URL of no registered medium is refused
    if is_url(src) and same_location(src, dst):
        raise CheckpointError("the destination would replace the source; choose another destination", path=dst)
    dest: Destination = url_destination(dst, to, limit, overwrite, options)
    try:
        with open_source(src, storage_options=options) as opened:
            source, user, tensors, total, bar = _opened(opened, shape, to)
            dropped, kept = write_to(dest, source, to, limit, dst, overwrite, bar, user)
    finally:
        dest.release()
    _warn_kept(kept, dst)
    _warn_lost(dropped, to, user)
    return ConvertResult(source.kind, to, dst, len(tensors), total, tuple(dropped))


def _warn_lost(dropped: list[str], to: str, user: dict[str, str] | None) -> None:
    """The ConversionWarnings for entries and user metadata the target format cannot hold."""
    fmt = family(to)
    if dropped:
        why = fmt.drops or "the format cannot hold them"
        warnings.warn(f"{len(dropped)} non-tensor entries were not converted ({why}): {', '.join(dropped)}",
                      ConversionWarning, stacklevel=3)
    lost = sorted(k for k, v in (user or {}).items() if (k, v) != ("format", "pt"))  # that marker carries nothing
    if lost and not fmt.user_metadata:
        warnings.warn(f"the user metadata ({', '.join(lost)}) was dropped: a {to} checkpoint cannot hold it "
                      "(convert to mmapckpt or safetensors to keep it)", ConversionWarning, stacklevel=3)


def _selected(source: Source, keys: Sequence[str] | None, strip_prefix: str | None,
              exclude: Sequence[str] | None = None) -> Source:
    """``source``, or the view of it that ``keys``, ``exclude`` and ``strip_prefix`` select."""
    if keys is None and strip_prefix is None and exclude is None:
        return source
    names = select_names([n for n, _ in source.items()], keys, strip_prefix, source.path, exclude)
    return SelectedSource(source, names, strip_prefix)


def _numel(size: tuple[int, ...]) -> int:
    n = 1
    for s in size:
        n *= s
    return n
