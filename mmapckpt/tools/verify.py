"""``mmapckpt verify``: check an mmapckpt checkpoint completely and report every problem.

Checks, in order: the metadata is present, committed and decodes; it lists a
storage record for every chunk and non-tensor entry; every shard file it names
exists, with a valid preamble and header whose entries lie in bounds, aligned and
without overlaps; every storage record matches a header entry (same file, offset,
length, kind, dtype and chunk shape); the CRC-32 of every entry's bytes matches.
Problems are collected, never raised one at a time, so one run shows them all.
Files in the directory that no metadata references (left-over shards, temp files,
files of other programs such as config.json) are listed with their sizes as
warnings: they do not make the checkpoint unsound.
"""

from __future__ import annotations

import fnmatch
import os
import re
from dataclasses import dataclass, field
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata

from ..errors import CheckpointError, CheckpointNotFoundError
from ..format import layout as fmt
from ..format.metadata import KIND_MMAPCKPT, find_metadata, read_metadata_file
from ..format.shard import Shard, check_size_unchanged
from ..io.files import open_inside
from ..io.progress import Progress, human_bytes

__all__ = ["Problem", "FileWarning", "VerifyReport", "verify_checkpoint"]


@dataclass(frozen=True)
class Problem:
    """One defect: the file and entry concerned and what is wrong."""

    path: str
    entry: str | None
    message: str

    @classmethod
    def of(cls, e: CheckpointError, path: str) -> "Problem":
        return cls(e.path or path, e.entry, e.message)

    def __str__(self) -> str:
        where = self.path + (f": entry {self.entry!r}" if self.entry else "")
        return f"{where}: {self.message}"


@dataclass(frozen=True)
class FileWarning:
    """A file in the checkpoint directory that no metadata references (not a defect)."""

    path: str
    size: int
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message} ({human_bytes(self.size)})"


@dataclass
class VerifyReport:
    """The outcome of :func:`verify_checkpoint`: what was checked, problems, warnings and notes (not defects)."""

    path: str
    checked: list[str] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    warnings: list[FileWarning] = field(default_factory=list)
    bytes_checked: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "ok": self.ok, "checked": self.checked, "notes": self.notes,
                "bytes_checked": self.bytes_checked,
                "warnings": [{"path": w.path, "bytes": w.size, "message": w.message} for w in self.warnings],
                "problems": [{"path": p.path, "entry": p.entry, "message": p.message} for p in self.problems]}


def _label(idx: MetadataIndex) -> str:
    return idx.fqn if idx.offset is None else f"{idx.fqn}@{list(idx.offset)}"


def verify_checkpoint(path: str | os.PathLike[str], *, progress: bool = False) -> VerifyReport:
    """Check the mmapckpt checkpoint at ``path``; return every problem found.

    Reads every byte of every entry (to check its CRC-32). The checkpoint is sound
    when ``report.ok``.

    Raises:
        CheckpointNotFoundError: ``path`` does not exist at all.

    Example:
        >>> report = verify_checkpoint("ckpt")  # doctest: +SKIP
        >>> report.ok, [str(p) for p in report.problems]  # doctest: +SKIP
    """
    p = os.fspath(path)
    if not os.path.exists(p):
        raise CheckpointNotFoundError("no such file or directory", path=p)
    report = VerifyReport(p)
    md = _check_metadata(p, report)
    if md is None:
        return report
    _check_coverage(p, md, report)
    per_file: dict[str, list[MetadataIndex]] = {}
    for idx, info in md.storage_data.items():
        per_file.setdefault(info.relative_path, []).append(idx)
    total = sum(info.length for info in md.storage_data.values())
    with Progress(total, "verify", enabled=progress) as bar:
        for rel in sorted(per_file):
            _check_shard(p, rel, per_file[rel], md, report, bar)
    _check_directory(p, set(per_file), report)
    return report


def _check_metadata(p: str, report: VerifyReport) -> Metadata | None:
    try:
        meta = find_metadata(p)
        kind, md = read_metadata_file(meta)
    except CheckpointError as e:
        report.problems.append(Problem.of(e, p))
        return None
    if kind != KIND_MMAPCKPT:
        report.problems.append(Problem(meta, None, "this is a stock DCP checkpoint (pickled metadata, torch.save "
                                       "items): verify checks mmapckpt checkpoints; convert it with "
                                       "`mmapckpt convert SRC DST --to mmapckpt`"))
        return None
    files = {info.relative_path for info in md.storage_data.values()}
    report.checked.append(f"metadata {meta}: committed, decodes, checksum matches; "
                          f"{len(md.state_dict_metadata)} entries, {len(md.storage_data)} storage records "
                          f"in {len(files)} shard files")
    return md


def _check_coverage(p: str, md: Metadata, report: VerifyReport) -> None:
    """Every chunk and non-tensor entry has a storage record; chunks cover their tensor exactly."""
    before = len(report.problems)
    for fqn, item in md.state_dict_metadata.items():
        if not isinstance(item, TensorStorageMetadata):
            if MetadataIndex(fqn) not in md.storage_data:
                report.problems.append(Problem(p, fqn, "non-tensor entry has no storage record (its data is missing)"))
            continue
        volume, numel = 0, 1
        for s in item.size:
            numel *= s
        for c in item.chunks:
            if MetadataIndex(fqn, c.offsets) not in md.storage_data:
                report.problems.append(Problem(p, f"{fqn}@{list(c.offsets)}", "chunk has no storage record"))
            v = 1
            for s in c.sizes:
                v *= s
            volume += v
        if volume != numel:
            report.problems.append(Problem(p, fqn, f"chunks hold {volume} elements but the tensor has {numel}"))
    for idx in md.storage_data:
        if idx.fqn not in md.state_dict_metadata:
            report.problems.append(Problem(p, _label(idx), "storage record for an entry the metadata does not list"))
    if len(report.problems) == before:
        report.checked.append("metadata: every chunk and non-tensor entry has a storage record; "
                              "chunks cover every tensor")


def _expect(md: Metadata, idx: MetadataIndex) -> tuple[str, str | None, tuple[int, ...] | None]:
    """(kind, dtype name, chunk shape) the metadata promises for ``idx``."""
    item = md.state_dict_metadata.get(idx.fqn)
    if not isinstance(item, TensorStorageMetadata):
        return fmt.KIND_BYTES, None, None
    for c in item.chunks:
        if tuple(c.offsets) == tuple(idx.offset or ()):
            return fmt.KIND_TENSOR, fmt.dtype_name(item.properties.dtype), tuple(c.sizes)
    return fmt.KIND_TENSOR, fmt.dtype_name(item.properties.dtype), None


def _check_shard(p: str, rel: str, records: list[MetadataIndex], md: Metadata, report: VerifyReport,
                 bar: Progress) -> None:
    before = len(report.problems)
    try:
        full = open_inside(p, rel)
        if not os.path.exists(full):
            names = ", ".join(sorted(_label(i) for i in records)[:5]) + (", ..." if len(records) > 5 else "")
            report.problems.append(Problem(full, None, f"shard file is missing; {len(records)} entries lost ({names})"))
            return
        shard = Shard(full)
    except CheckpointError as e:
        report.problems.append(Problem.of(e, os.path.join(p, rel)))
        return
    save_id = getattr(md.storage_meta, "save_id", None)
    if shard.header.save_id is not None and save_id is not None and shard.header.save_id != save_id:
        report.problems.append(Problem(full, None, f"shard was written by save {shard.header.save_id}, the metadata "
                                       f"by save {save_id}: a shard of another checkpoint was mixed in"))
    used = set()
    for idx in records:
        kind, dtype, shape = _expect(md, idx)
        info = md.storage_data[idx]
        e = shard.header.by_key().get((idx.fqn, None if kind == fmt.KIND_BYTES else tuple(idx.offset or ())))
        if e is None:
            report.problems.append(Problem(full, _label(idx), "metadata names this entry but the shard header lacks it"))
            continue
        used.add(e.key)
        diffs = []
        if (info.offset, info.length) != (e.offset, e.length):
            diffs.append(f"metadata says bytes [{info.offset}, +{info.length}), header says [{e.offset}, +{e.length})")
        if e.kind != kind:
            diffs.append(f"metadata says {kind}, header says {e.kind}")
        elif kind == fmt.KIND_TENSOR and (e.dtype != dtype or e.shape != shape):
            diffs.append(f"metadata says {dtype} {list(shape or ())}, header says {e.dtype} {list(e.shape)}")
        report.problems.extend(Problem(full, e.label, d) for d in diffs)
    for e in shard.header.entries:
        try:
            shard.verify(e)
        except CheckpointError as err:
            report.problems.append(Problem.of(err, full))
        bar.advance(e.length)
        report.bytes_checked += e.length
        if e.key not in used:
            report.notes.append(f"{full}: header entry {e.label!r} is not referenced by the metadata (unused)")
    try:
        check_size_unchanged(shard)
    except CheckpointError as err:
        report.problems.append(Problem.of(err, full))
    if len(report.problems) == before:
        report.checked.append(f"{rel}: preamble and header valid (format {fmt.FORMAT_MAJOR}.{shard.header.minor}, "
                              f"{len(shard.header.entries)} entries in bounds, aligned, not overlapping); "
                              f"matches the metadata; {len(shard.header.entries)} checksums match "
                              f"({human_bytes(sum(e.length for e in shard.header.entries))})")


_COMMITS = (".metadata", "__*.metadata")
_SHARD = re.compile(r"^__\d+_\d+(\.[0-9a-f]{8})?\.distcp$")
_TEMP = re.compile(r"^\..*\.tmp-[0-9a-z-]+$")


def _why_unreferenced(name: str) -> str:
    if _SHARD.match(name):
        return "not referenced by the metadata: shard file left over by an earlier save (safe to delete)"
    if _TEMP.match(name):
        return "not referenced by the metadata: temporary file of an unfinished write (safe to delete)"
    return "not referenced by the metadata: not part of the checkpoint (kept; verify did not check it)"


def _check_directory(p: str, referenced: set[str], report: VerifyReport) -> None:
    """Every regular file that is neither a commit (metadata) file nor referenced is a warning with its size."""
    for name in sorted(os.listdir(p)):
        full = os.path.join(p, name)
        if name in referenced or any(fnmatch.fnmatchcase(name, c) for c in _COMMITS):
            continue
        try:
            st = os.lstat(full)
        except OSError:
            continue
        if os.path.isfile(full) and not os.path.islink(full):
            report.warnings.append(FileWarning(full, st.st_size, _why_unreferenced(name)))
