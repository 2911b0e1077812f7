"""What every conversion source and sink shares: the formats, the dtype table, the Source interface.

Every source, whatever its format, answers the same questions: its DCP ``Metadata``
(state_dict_metadata and planner_data; storage_data for DCP checkpoints), its file
layout (which items live in which file, in file order) and the bytes of one item at
a time. Non-DCP files (safetensors, torch.save) get the metadata ``dcp.save`` would
have written for them on one rank: one chunk per tensor, one file ``__0_0.distcp``.
Items are read one at a time, so a conversion never holds more than one of them.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata

from ..errors import CheckpointError, CheckpointWriteError
from ..reading.keys import check_patterns, matches
from ..reading.keys import select_names as keys_select
from ..reading.formats import FORMATS
from ..reading.hf_dirs import SAFETENSORS_INDEX, SAFETENSORS_SINGLE
from ..format.safetensors import SAFETENSORS_DTYPES

if TYPE_CHECKING:
    from .progress import Progress

__all__ = ["FORMATS", "SinkJob", "SAFETENSORS_DTYPES", "SAFETENSORS_INDEX", "SAFETENSORS_SINGLE", "SINGLE_FILE", "Source", "label",
           "tensor_chunk_sizes", "SelectedSource", "select_names", "RecordingFile", "Writing"]

SINGLE_FILE = "__0_0.distcp"
# FORMATS, the Hugging Face file names and the safetensors dtype table (codes <-> torch dtypes) are
# defined once, in the format wing, beside the one safetensors header parser.


@dataclass(frozen=True)
class SinkJob:
    """What a sink writes, besides its source and the new version it writes into: every format's sink (the format
    table's ``sink``, reading/formats.py) is ``sink(source, out, job) -> (entries left out, the commit's name)``.

    Attributes:
        name: the file's name in the new version, where the output is one file (``out.name``, or the record's
            ``dir_file`` in a directory).
        as_dir: whether the output is a directory.
        max_shard_size: the largest shard, for formats that take it (else None).
        checkpoint_id: what a DCP checkpoint's metadata records as its id.
        progress: the bar the sink advances.
        user_metadata: the source's user metadata ({str: str}), for formats that hold it.
    """

    name: str
    as_dir: bool
    max_shard_size: int | None
    checkpoint_id: str
    progress: "Progress"
    user_metadata: dict[str, str] | None = None


def label(idx: MetadataIndex) -> str:
    return idx.fqn if idx.offset is None else f"{idx.fqn}@{list(idx.offset)}"


def tensor_chunk_sizes(md: Metadata) -> dict[tuple[str, tuple[int, ...]], tuple[int, ...]]:
    """(fqn, chunk offsets) -> chunk sizes, for every chunk the metadata lists."""
    return {(fqn, tuple(c.offsets)): tuple(c.sizes)
            for fqn, item in md.state_dict_metadata.items() if isinstance(item, TensorStorageMetadata)
            for c in item.chunks}


class Source:
    """A checkpoint opened for reading, one item at a time.

    Attributes:
        kind: one of FORMATS.
        path: what was opened.
        version: a human-readable description of the format version.
        metadata: DCP metadata; ``storage_data`` is None for non-DCP sources.
        layout: ``[(relative file name, [MetadataIndex, ...]), ...]`` in file order.
        files: number of files the checkpoint's data lives in.
        side_files: whether the source is a Hugging Face directory whose side files (config, tokenizer)
            go with its weights into a Hugging Face directory written from it.
    """

    side_files: bool = False

    kind: str
    path: str
    version: str
    metadata: Metadata
    layout: list[tuple[str, list[MetadataIndex]]]
    files: int

    def read_tensor(self, idx: MetadataIndex) -> torch.Tensor:
        """The stored chunk named by ``idx``, of its dtype and chunk shape."""
        raise NotImplementedError

    def read_bytes(self, idx: MetadataIndex) -> bytes:
        """A non-tensor entry as DCP stores it: ``torch.save`` bytes of the object."""
        raise NotImplementedError

    def bytes_length(self, idx: MetadataIndex) -> int:
        return len(self.read_bytes(idx))

    def read_object(self, idx: MetadataIndex) -> Any:
        """A non-tensor entry as an object, unpickled with ``weights_only=True`` (never arbitrary code)."""
        return torch.load(io.BytesIO(self.read_bytes(idx)), weights_only=True)

    def items(self) -> Iterator[tuple[str, Any]]:
        return iter(self.metadata.state_dict_metadata.items())

    def user_metadata(self) -> dict[str, str] | None:
        """The checkpoint's user metadata ({str: str}: safetensors' ``__metadata__``, mmapckpt's
        ``user_metadata``), or None where the format has none."""
        return None

    def close(self) -> None:
        pass

    def __enter__(self) -> "Source":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --------------------------------------------------------------------------- convert(keys=, strip_prefix=)
def select_names(names: Sequence[str], keys: Sequence[str] | None, strip_prefix: str | None,
                 path: str, exclude: Sequence[str] | None = None) -> dict[str, str]:
    """``{new name: stored name}`` for ``convert(keys=, exclude=, strip_prefix=)``: the names
    ``reading/keys.py``'s :func:`~mmapckpt.reading.keys.select_names` (the one matcher ``load(keys=)``
    also uses) selects, less those matching a glob of ``exclude``, its messages spelled as the command
    line's ``--keys``/``--strip-prefix``.

    Raises:
        TypeError, ValueError: ``keys`` or ``exclude`` is a single string or empty; ``strip_prefix`` is empty.
        CheckpointError: no name matches ``keys``, or ``exclude`` leaves none; no selected name starts with
            ``strip_prefix``; stripping makes two names one (or one empty).
    """
    flags = ("--keys", "--strip-prefix")
    if exclude is None:
        return keys_select(names, keys, strip_prefix, path, flags=flags)
    chosen = _excluded(list(keys_select(names, keys, None, path, flags=flags)), exclude, path)
    return keys_select(chosen, None, strip_prefix, path, flags=flags)


def _excluded(chosen: list[str], exclude: Sequence[str], path: str) -> list[str]:
    """``chosen`` without the names matching a glob of ``exclude`` (``--exclude``)."""
    try:
        pats = check_patterns(exclude)
    except (TypeError, ValueError) as e:
        raise type(e)(str(e).replace("keys", "exclude", 1)) from None
    kept = [n for n in chosen if not matches(n, pats)]
    if not kept:
        raise CheckpointError(f"--exclude {' '.join(pats)} leaves no entry to convert", path=path)
    return kept


def _stripped_path(path: tuple[Any, ...], new: str, prefix: str) -> tuple[Any, ...]:
    """A planner_data path (nested keys) without the leading keys that spell ``prefix``."""
    k, spelled = 0, ""
    while k < len(path) and len(spelled) < len(prefix):
        spelled += f"{path[k]}."
        k += 1
    return tuple(path[k:]) if spelled == prefix and k < len(path) else (new,)


class SelectedSource(Source):
    """``inner`` seen through :func:`select_names`: only the selected entries, under their new names."""

    def __init__(self, inner: Source, names: dict[str, str], strip_prefix: str | None) -> None:
        self._inner, self._old = inner, names
        self.kind, self.path, self.version, self.files = inner.kind, inner.path, inner.version, inner.files
        self.side_files = inner.side_files
        md = inner.metadata
        new_of = {old: new for new, old in names.items()}
        pd = md.planner_data
        if pd is not None:
            pd = {new_of[k]: (v if new_of[k] == k else _stripped_path(tuple(v), new_of[k], strip_prefix or ""))
                  for k, v in pd.items() if k in new_of}
        storage = None if md.storage_data is None else {
            MetadataIndex(new_of[i.fqn], i.offset, i.index): info for i, info in md.storage_data.items()
            if i.fqn in new_of}
        self.metadata = Metadata(state_dict_metadata={new_of[k]: v for k, v in md.state_dict_metadata.items()
                                                      if k in new_of},
                                 planner_data=pd, storage_data=storage, storage_meta=md.storage_meta,
                                 version=md.version)
        self.layout = [(rel, kept) for rel, idxs in inner.layout
                       if (kept := [MetadataIndex(new_of[i.fqn], i.offset, i.index) for i in idxs if i.fqn in new_of])]

    def _back(self, idx: MetadataIndex) -> MetadataIndex:
        return MetadataIndex(self._old[idx.fqn], idx.offset, idx.index)

    def read_tensor(self, idx: MetadataIndex) -> torch.Tensor:
        return self._inner.read_tensor(self._back(idx))

    def read_bytes(self, idx: MetadataIndex) -> bytes:
        return self._inner.read_bytes(self._back(idx))

    def bytes_length(self, idx: MetadataIndex) -> int:
        return self._inner.bytes_length(self._back(idx))

    def read_object(self, idx: MetadataIndex) -> Any:
        return self._inner.read_object(self._back(idx))

    def user_metadata(self) -> dict[str, str] | None:
        return self._inner.user_metadata()

    def close(self) -> None:
        self._inner.close()


# --------------------------------------------------------------------------- write failures, typed (sinks)
class RecordingFile:
    """A binary file for ``torch.save`` that keeps the OSError a write met: torch turns it into a
    RuntimeError that has lost the errno and the reason ("unexpected pos ...")."""

    def __init__(self, f: Any) -> None:
        self.f, self.error = f, None  # the OSError (or KeyboardInterrupt) a write met

    def write(self, b: Any) -> int:
        try:
            return self.f.write(b)
        except (OSError, KeyboardInterrupt) as e:  # torch.save turns both into a RuntimeError
            self.error = e
            raise

    def flush(self) -> None:
        self.f.flush()

    def tell(self) -> int:
        return self.f.tell()


class Writing:
    """``with Writing(path) as w:`` (``w.entry = name`` as it goes): an OSError, or torch.save's
    RuntimeError, becomes a CheckpointWriteError naming ``path`` and the entry being written.

    Enter it before opening the file, so that a failing flush when the file closes is caught too;
    ``w.record(f)`` gives the file to hand to ``torch.save``.
    """

    def __init__(self, path: str) -> None:
        self.path, self.entry = path, None
        self.out: RecordingFile | None = None

    def record(self, f: Any) -> RecordingFile:
        self.out = RecordingFile(f)
        return self.out

    def __enter__(self) -> "Writing":
        return self

    def __exit__(self, kind: Any, e: BaseException | None, tb: Any) -> bool:
        if e is None or isinstance(e, CheckpointError) or not isinstance(e, (OSError, RuntimeError)):
            return False
        if self.out is not None and isinstance(self.out.error, KeyboardInterrupt):
            raise KeyboardInterrupt from None  # Ctrl-C inside torch.save is still Ctrl-C
        reason: BaseException = e
        if isinstance(e, RuntimeError) and self.out is not None and self.out.error is not None:
            reason = self.out.error  # what the disk said, under torch.save's RuntimeError
        inner: BaseException | None = e if isinstance(e, RuntimeError) else e.__context__
        while inner is not None:  # torch.save's frames hold the tensors it was writing (mapped files):
            inner.__traceback__ = None  # a failure kept for a while must not keep their pages
            inner = inner.__cause__ or inner.__context__
        reason.__traceback__ = None  # nor the frames of the write that failed, which hold its buffer
        tb = None  # noqa: F841 - nor this frame, which the new error's traceback keeps
        raise CheckpointWriteError(f"writing failed: {reason}", path=self.path, entry=self.entry) from reason
