"""``mmapckpt inspect``: what a checkpoint holds, for any supported format.

Pure functions returning data; the command line only prints it. The checkpoint is opened through the format
table (reading/formats.py) and the backend ``open`` reads it through, and described from its entry index: no
torch for an mmapckpt checkpoint or safetensors files (dtypes by name), which makes ``mmapckpt inspect`` a
fraction of a second; a stock DCP checkpoint (a pickle of DCP's classes) and torch.save files need torch.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from ..conversion.progress import human_bytes
from ..errors import CheckpointError
from ..format import layout as fmt
from ..format.entries import EntryInfo
from ..format.metadata import KIND_MMAPCKPT, decode_index
from ..reading.formats import FORMATS, STOCK_READER_NOTE, Format, family
from ..reading.keys import select_names
from ..reading.locate import find_checkpoint
from ..reading.located import Place
from ..reading.opened import Opened, open_dcp
from ..reading.shard import Shard
from .wording import count

__all__ = ["EntrySummary", "CheckpointInfo", "inspect_checkpoint", "format_table", "STOCK_READER_NOTE"]


@dataclass(frozen=True)
class EntrySummary:
    """One state-dict entry.

    Attributes:
        name: the DCP fully-qualified name.
        kind: ``"tensor"`` or ``"bytes"`` (a pickled non-tensor object).
        dtype: the dtype's on-disk name, for tensors.
        shape: the global shape, for tensors.
        chunks: stored chunks (pieces written by different ranks).
        nbytes: bytes of data (for bytes entries, the stored pickle's length).
    """

    name: str
    kind: str
    dtype: str | None
    shape: tuple[int, ...] | None
    chunks: int
    nbytes: int


@dataclass(frozen=True)
class CheckpointInfo:
    """A checkpoint's format and entries, as ``mmapckpt inspect`` shows them.

    Attributes:
        path: the path inspected.
        format: ``"mmapckpt"``, ``"dcp"``, ``"safetensors"`` or ``"torch"``.
        version: the format's version, as a human-readable string.
        files: how many data files the checkpoint has.
        entries: one summary (name, kind, dtype, shape, chunks, bytes) per entry (those ``keys`` selected).
        metadata: the user metadata ({str: str}: a safetensors header's ``__metadata__``,
            ``mmapckpt.save(metadata=...)``), or None where the checkpoint has none.
    """

    path: str
    format: str
    version: str
    files: int
    entries: tuple[EntrySummary, ...]
    metadata: dict[str, str] | None = None

    @property
    def total_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    @property
    def tensors(self) -> int:
        return sum(e.kind == "tensor" for e in self.entries)

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path, "format": self.format, "version": self.version, "files": self.files,
            "metadata": self.metadata, "entries": [{**asdict(e), "shape": None if e.shape is None else list(e.shape)} for e in self.entries],
            "totals": {"entries": len(self.entries), "tensors": self.tensors,
                       "non_tensors": len(self.entries) - self.tensors, "bytes": self.total_bytes},
        }


def inspect_checkpoint(path: str | os.PathLike[str], *, keys: Sequence[str] | None = None,
                       storage_options: Mapping[str, Any] | None = None) -> CheckpointInfo:
    """Describe the checkpoint at ``path`` (mmapckpt, stock DCP, safetensors or torch.save).

    Reads metadata and headers only (a local torch.save file is mapped, not read; one at a URL
    is read whole, as its format has no index to read by), through the backend ``open`` reads the
    checkpoint through: a missing, cut or foreign data file raises as it does there.

    Args:
        path: a checkpoint directory or file in any supported format, or a URL of a registered medium.
        keys: describe only the entries whose stored name matches one of these globs (as
            ``convert(keys=...)``: ``fnmatch``, case-sensitive, ``*`` also matches dots).
        storage_options: for the medium of a URL (``storage/location.py`` ``storage_for``).

    Returns:
        A CheckpointInfo: the format, its version, the files, the user metadata and one summary per entry.

    Raises:
        CheckpointError: nothing recognisable at ``path`` (a single ``.distcp`` shard file is named
            as what it is: one file of a checkpoint directory), its metadata is damaged, or no entry
            matches ``keys``.

    Example:
        >>> info = inspect_checkpoint("ckpt")  # doctest: +SKIP
        >>> [(e.name, e.dtype, e.shape) for e in info.entries]  # doctest: +SKIP
    """
    _refuse_shard_file(os.fspath(path))
    place, record = find_checkpoint(path, storage_options=storage_options)
    opened, version = _opened(place, record)
    try:
        names = list(opened.entries)
        chosen = None if keys is None else set(select_names(names, keys, None, place.path,
                                                            flags=("--keys", "--strip-prefix")).values())
        entries = tuple(_summary(opened, opened.entries[n]) for n in names if chosen is None or n in chosen)
        files = len(opened.layout) if opened.layout is not None else \
            len({c.file for e in opened.entries.values() for c in e.chunks})
        return CheckpointInfo(os.fspath(path), opened.kind, version, files, entries, opened.user_metadata())
    finally:
        opened.files.close()


def _opened(place: Place, record: Format) -> tuple[Opened, str]:
    """The checkpoint at ``place`` opened by its record (every data file opened and checked, as ``open`` does), and
    its version in words."""
    if record.files is not None:  # flat files: the record says its version
        files, index = record.files(place)
        opened = record.opener(place, files, False)  # type: ignore[misc]
        return opened, record.version(opened, index)  # type: ignore[misc]
    storage = place.storage
    commit = storage.read_commit()
    if commit.kind == KIND_MMAPCKPT:
        ix = decode_index(commit.data, commit.full)  # read once: the index and the version
        opened = open_dcp(place, None, False, commit, index=(ix.entries, ix.save_id))
        version = f"DCP metadata {ix.doc.get('version')}"
    else:
        from ..format.metadata.stock import decode_stock_index  # DCP's classes: a stock commit is a pickle of them

        md, entries = decode_stock_index(commit.data, commit.full)
        opened = open_dcp(place, None, False, commit, index=(entries, getattr(md.storage_meta, "save_id", None)))
        version = f"DCP metadata {md.version}, torch.save items"
    shards = getattr(opened.files, "shards", {})
    first = shards[min(shards)] if shards else None
    if first is not None:
        version = f"shard format {fmt.FORMAT_MAJOR}.{first.header.minor}, {version}"
    return opened, version


def _summary(opened: Opened, e: EntryInfo) -> EntrySummary:
    if e.kind == "tensor":
        return EntrySummary(e.name, "tensor", e.dtype_name, e.shape, len(e.chunks), e.nbytes)
    if opened.files.pickled_objects:  # stored as a pickle (DCP): its length
        return EntrySummary(e.name, "bytes", None, None, 1, e.nbytes)
    import io

    import torch  # a torch.save file's value: its length as DCP would store it

    buf = io.BytesIO()
    torch.save(opened.files.object_value(e), buf)
    return EntrySummary(e.name, "bytes", None, None, 1, len(buf.getvalue()))


def _refuse_shard_file(path: str) -> None:
    """A ``.distcp`` file is one data file of a DCP checkpoint: say so, and what to inspect instead (torch.load
    of a stock one reads one item and says nothing useful; an mmapckpt one is no torch.save file at all)."""
    if not (path.endswith(".distcp") and os.path.isfile(path)):
        return
    directory = os.path.dirname(path) or "."
    try:
        shard = Shard(path, check_entries=False)
    except CheckpointError:  # not an mmapckpt shard: the data file of a stock DCP checkpoint
        raise CheckpointError("this is a data file of a stock DCP checkpoint (torch.save items that only the "
                              f"directory's .metadata names and places): inspect the checkpoint directory, "
                              f"`mmapckpt inspect {directory}`", path=path) from None
    try:
        n = len(shard.header.entries)
        what = f"format {fmt.FORMAT_MAJOR}.{shard.header.minor}, {count(n, 'entry')}"
    except CheckpointError as e:
        what = f"its header is damaged: {e}"
    finally:
        shard.close()
    raise CheckpointError(f"this is one shard file of an mmapckpt checkpoint ({what}); its names, shapes and "
                          f"the other shards are in the directory's .metadata: inspect the checkpoint directory, "
                          f"`mmapckpt inspect {directory}` (or check it with `mmapckpt verify {directory}`)",
                          path=path)


def format_table(info: CheckpointInfo) -> str:
    """The human-readable report: a heading, one row per entry, and totals."""
    rows = [("name", "dtype", "shape", "chunks", "bytes")]
    for e in info.entries:
        shape = "-" if e.shape is None else "[" + ", ".join(map(str, e.shape)) + "]"
        rows.append((e.name, e.dtype or "(object)", shape, str(e.chunks), human_bytes(e.nbytes)))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    lines = [f"{info.path}: {info.format} ({info.version}), {count(info.files, 'file')}", ""]
    if info.metadata:
        lines += ["metadata:"] + [f"  {k}: {v}" for k, v in info.metadata.items()] + [""]
    for r in rows:
        lines.append("  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip())
    others = len(info.entries) - info.tensors
    lines += ["", f"total: {count(len(info.entries), 'entry')} ({count(info.tensors, 'tensor')}, {others} non-tensor), "
                  f"{human_bytes(info.total_bytes)} ({info.total_bytes} bytes)"]
    note = family(info.format).note if info.format in FORMATS else ""
    if note:
        lines.append(note)
    return "\n".join(lines)
