"""``mmapckpt verify``: check an mmapckpt checkpoint completely and report every problem.

Checks, in order: the metadata is present, committed and decodes; it lists a
storage record for every chunk and non-tensor entry; every shard file it names
exists, with a valid preamble and header whose entries lie in bounds, aligned and
without overlaps; every storage record matches a header entry (same file, offset,
length, kind, dtype and chunk shape); the CRC-32 of every entry's bytes matches.
Problems are collected, never raised one at a time, so one run shows them all.

Other formats get the checks they allow (``_verify_flat``): a safetensors file or Hugging
Face directory its index (every file present, every name in its file's header) and every
header (dtypes known, shapes matching their byte ranges, data tiled to the end of the file;
there are no checksums, so the data bytes cannot be checked); a torch.save file that it
loads with ``weights_only=True`` and, for the zip format, the CRC-32 of every archive
member (which ``torch.load`` itself never checks). Only mmapckpt checkpoints have a
checksum per entry.
Files in the directory that no metadata references (left-over shards, temp files,
files of other programs such as config.json) are listed with their sizes as
warnings: they do not make the checkpoint unsound.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import os
import re
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from ..errors import CheckpointError, CheckpointNotFoundError, FormatError, IncompleteCheckpointError
from ..format import layout as fmt
from ..reading.located import Place, locate
from ..reading.formats import Format, recognise, resolve
from ..reading.opened import safetensors_union
from ..format.metadata import KIND_MMAPCKPT
from ..format.safetensors import entry_infos
from ..format.transforms import StreamTransforms
from ..conversion.progress import Progress, human_bytes
from ..reading.safetensors_files import SafetensorsFile
from ..reading.shard import Shard, check_size_unchanged, decode_entry, file_save_id, open_named, shard_of
from ..reading.torchfile import TorchSource, flat_torch_file, is_zip, torch_source
from ..storage.base import CheckpointStorage
from ..dcp.metadata import read_metadata
from ..storage.commits import read_user_metadata
from ..storage.location import is_url, storage_for
from .wording import count

__all__ = ["Problem", "FileWarning", "VerifyReport", "verify_checkpoint"]


@dataclass(frozen=True)
class Problem:
    """One defect: the file and entry concerned and what is wrong.

    Attributes:
        error: the name of the CheckpointError subclass that reading the checkpoint raises for it (``open``,
            ``load``, ``dcp.load`` and ``convert`` raise the same class for the same damage).
    """

    path: str
    entry: str | None
    message: str
    error: str = "CheckpointError"

    @classmethod
    def of(cls, e: CheckpointError, path: str) -> "Problem":
        return cls(e.path or path, e.entry, e.message, type(e).__name__)

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
    """The outcome of :func:`verify_checkpoint`: what was checked, problems, warnings and notes (not defects).

    Attributes:
        path: the path verified.
        checked: one line per check that passed.
        problems: every defect found, each naming its file and entry; ``ok`` is True without any.
        notes: facts worth knowing that are not defects (e.g. what a format cannot check).
        warnings: files in the directory that the checkpoint does not reference, with their sizes.
        bytes_checked: bytes whose checksums were checked.
    """

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
                "problems": [{"path": p.path, "entry": p.entry, "message": p.message, "error": p.error}
                             for p in self.problems]}


def _label(idx: MetadataIndex) -> str:
    return idx.fqn if idx.offset is None else f"{idx.fqn}@{list(idx.offset)}"


def verify_checkpoint(path: str | os.PathLike[str], *, progress: bool = False,
                      storage_options: Mapping[str, Any] | None = None) -> VerifyReport:
    """Check the checkpoint at ``path``; return every problem found.

    For an mmapckpt checkpoint, reads every byte of every entry (to check its CRC-32).
    A safetensors file or Hugging Face directory, or a torch.save file, gets the checks its
    format allows (see the module's docstring; ``report.checked`` and ``report.notes`` say
    which). The checkpoint is sound when ``report.ok``.

    Args:
        path: a checkpoint directory or file, or a URL of a registered medium (reading/located.py).
        progress: draw a progress bar on stderr when it is a terminal.
        storage_options: for the medium of a URL (``storage/location.py`` ``storage_for``).

    Raises:
        CheckpointNotFoundError: ``path`` does not exist at all.

    Example:
        >>> report = verify_checkpoint("ckpt")  # doctest: +SKIP
        >>> report.ok, [str(p) for p in report.problems]  # doctest: +SKIP
    """
    p = os.fspath(path)
    try:
        place: Place | None = resolve(locate(p, options=storage_options))
    except CheckpointNotFoundError:
        if is_url(p) or not os.path.exists(p):
            raise
        place = None  # neither a file nor a directory: the metadata check reports it
    report = VerifyReport(p)
    flat = _flat_format(place) if place is not None else None
    if flat is not None:
        _FLAT_CHECKS[flat.family](place, flat, report, progress)
        return report
    dir_place = place is not None and place.is_dir
    storage = place.storage if dir_place else storage_for(p, options=storage_options)  # type: ignore[union-attr]
    md = _check_metadata(storage, report)
    if md is None:
        return report
    _check_coverage(p, md, report)
    per_file: dict[str, list[MetadataIndex]] = {}
    for idx, info in md.storage_data.items():
        per_file.setdefault(info.relative_path, []).append(idx)
    total = sum(info.length for info in md.storage_data.values())
    with Progress(total, "verify", enabled=progress) as bar:
        for rel in sorted(per_file):
            _check_shard(storage, rel, per_file[rel], md, report, bar)
    _check_directory(storage, p, is_url(p), set(per_file), report)
    return report


def _flat_format(place: Place) -> Format | None:
    """The format table's record of a checkpoint of flat files (safetensors, torch.save) at ``place``; None for
    anything else (DCP directories, and places that hold no checkpoint: the metadata check reports those)."""
    try:
        fmt = recognise(place)
    except CheckpointError:
        return None
    return fmt if fmt.files is not None else None


def _flat_bytes(src: TorchSource) -> int:
    if is_zip(src):
        with zipfile.ZipFile(_rewound(src)) as z:
            return sum(i.file_size for i in z.infolist())
    return 0


def _rewound(src: TorchSource) -> Any:
    if not isinstance(src, str):
        src.seek(0)
    return src


_NO_CHECKSUMS = ("safetensors files carry no checksums: the tensors' bytes could not be checked (only mmapckpt "
                 "checkpoints have a CRC-32 per entry: `mmapckpt convert SRC DST --to mmapckpt` makes one)")


def _index_files(place: Place, fmt: Format, report: VerifyReport) -> dict[str, list[str] | None] | None:
    """The files of the checkpoint at ``place`` (its record's ``files``), its index reported as checked; None,
    with the problem reported, where the index or a file it names is damaged or missing."""
    try:
        files, idx = fmt.files(place)  # type: ignore[misc]
    except CheckpointError as e:
        report.problems.append(Problem.of(e, place.path))
        return None
    if idx is not None:
        report.checked.append(f"index {place.full(idx)}: {count(sum(len(n or ()) for n in files.values()), 'tensor')} "
                              f"in {count(len(files), 'file')}, every file present")
    return files


def _verify_safetensors(place: Place, fmt: Format, report: VerifyReport, progress: bool) -> None:
    with Progress(0, "verify", enabled=progress):
        files = _index_files(place, fmt, report)
        if files is not None:
            _check_safetensors_files(place, files, report)


def _check_safetensors_files(place: Place, files: dict[str, list[str] | None], report: VerifyReport) -> None:
    parts = []
    for rel, names in files.items():
        full = place.full(rel)
        try:
            f = SafetensorsFile(place.open(rel))
            f.close()
            header = f.header
            entry_infos(header, full, names)  # every name the index puts in this file is in its header
        except CheckpointError as e:
            report.problems.append(Problem.of(e, full))
            continue
        for extra in sorted(set(header.entries) - set(names)) if names is not None else ():
            report.notes.append(f"{full}: tensor {extra!r} is in the header but not in the index's weight_map "
                                "(loaders that follow the index skip it)")
        report.checked.append(f"{full}: header valid ({count(len(header.entries), 'tensor')}: known dtypes, shapes match "
                              "their byte ranges, data tiled without overlap or gap to the end of the file)")
        parts.append((rel, header, names))
    if len(parts) == len(files) > 1:
        try:  # the files read together: no name in two of them (but distinct DCP_SHARDING_INFO chunks)
            safetensors_union(place, parts)
        except CheckpointError as e:
            report.problems.append(Problem.of(e, place.path))
    report.notes.append(_NO_CHECKSUMS)


def _verify_torch_files(place: Place, fmt: Format, report: VerifyReport, progress: bool) -> None:
    """A torch.save file, or a Hugging Face directory of them (``pytorch_model.bin`` or an index and its
    shards): each file as :func:`_verify_torch` checks one, and every name the index puts in a shard there."""
    files = _index_files(place, fmt, report)
    for rel, names in (files or {}).items():
        src = torch_source(place, None if place.name is not None else rel)  # at a URL: read once, for both checks
        full = place.path if place.name is not None else place.full(rel)
        with Progress(_flat_bytes(src), "verify", enabled=progress) as bar:
            flat = _verify_torch(src, full, report, bar)
        for name in sorted(set(names or ()) - set(flat or ())) if flat is not None else ():
            report.problems.append(Problem(full, name, "the index puts this tensor in this file, but the file does "
                                                       "not hold it (re-download or re-save the checkpoint)",
                                           "FormatError"))


def _verify_torch(src: TorchSource, p: str, report: VerifyReport, bar: Progress) -> dict[str, Any] | None:
    """Check one torch.save file; returns its flattened entries (None where it does not load)."""
    flat: dict[str, Any] | None = None
    try:
        flat, _ = flat_torch_file(src)
        tensors = sum(1 for v in flat.values() if hasattr(v, "dtype"))
        report.checked.append(f"{p}: loads with torch.load(weights_only=True): {count(len(flat), 'entry')} ("
                              f"{count(tensors, 'tensor')}), no code run")
    except CheckpointError as e:
        report.problems.append(Problem.of(e, p))
    if not is_zip(src):
        report.notes.append(f"{p}: legacy (pre-1.6) torch.save format: it has no checksums, its bytes could not "
                            "be checked")
        return flat
    before, members = len(report.problems), 0
    with zipfile.ZipFile(_rewound(src)) as z:
        for info in z.infolist():
            members += 1
            try:
                with z.open(info) as f:
                    while chunk := f.read(8 << 20):
                        bar.advance(len(chunk))
                        report.bytes_checked += len(chunk)
            except Exception as e:  # noqa: BLE001 - zipfile's CRC, zlib and format errors: all a damaged member
                report.problems.append(Problem(p, info.filename, f"zip member does not read back intact: {e}",
                                           "ChecksumError"))
    if len(report.problems) == before:
        report.checked.append(f"{p}: zip archive: {count(members, 'member CRC-32')} match{'es' * (members == 1)} (torch.load itself does not "
                              "check them)")
    return flat


#: The checks of each family of flat files.
_FLAT_CHECKS = {"safetensors": _verify_safetensors, "torch": _verify_torch_files}


def _check_metadata(storage: CheckpointStorage, report: VerifyReport) -> Metadata | None:
    try:
        name = storage.find_metadata()
        meta = storage.full(name)
        kind, md = read_metadata(storage, name)  # shapes, chunk tiling and stored ranges checked (format/tiling.py)
        read_user_metadata(storage, name)  # {str: str} or absent, as convert demands
    except CheckpointError as e:
        report.problems.append(Problem.of(e, storage.location))
        return None
    if kind != KIND_MMAPCKPT:
        report.problems.append(Problem(meta, None, "this is a stock DCP checkpoint (pickled metadata, torch.save "
                                       "items): verify checks mmapckpt checkpoints; convert it with "
                                       "`mmapckpt convert SRC DST --to mmapckpt`"))
        return None
    files = {info.relative_path for info in md.storage_data.values()}
    report.checked.append(f"metadata {meta}: committed, decodes, checksum matches; "
                          f"{count(len(md.state_dict_metadata), 'entry')}, {count(len(md.storage_data), 'storage record')} "
                          f"in {count(len(files), 'shard file')}")
    return md


def _check_coverage(p: str, md: Metadata, report: VerifyReport) -> None:
    """Every chunk and non-tensor entry has a storage record (the decoder checked that they tile their tensor)."""
    before = len(report.problems)
    for fqn, item in md.state_dict_metadata.items():
        if not isinstance(item, TensorStorageMetadata):
            if MetadataIndex(fqn) not in md.storage_data:
                report.problems.append(Problem(p, fqn, "non-tensor entry has no storage record (its data is missing)",
                                               "FormatError"))
            continue
        for c in item.chunks:
            if MetadataIndex(fqn, c.offsets) not in md.storage_data:
                report.problems.append(Problem(p, f"{fqn}@{list(c.offsets)}", "chunk has no storage record", "FormatError"))
    for idx in md.storage_data:
        if idx.fqn not in md.state_dict_metadata:
            report.problems.append(Problem(p, _label(idx), "storage record for an entry the metadata does not list",
                                          "FormatError"))
    if len(report.problems) == before:
        report.checked.append("metadata: every chunk and non-tensor entry has a storage record; "
                              "chunks tile every tensor exactly, stored byte ranges shared only by tied weights")


def _expect(md: Metadata, idx: MetadataIndex,
            sizes: dict[str, dict[tuple[int, ...], tuple[int, ...]]]) -> tuple[str, str | None, tuple[int, ...] | None]:
    """(kind, dtype name, chunk shape) the metadata promises for ``idx``; ``sizes`` caches each tensor's
    chunk shapes by offsets, so that a tensor of many chunks is looked up in constant time."""
    item = md.state_dict_metadata.get(idx.fqn)
    if not isinstance(item, TensorStorageMetadata):
        return fmt.KIND_BYTES, None, None
    by_offsets = sizes.get(idx.fqn)
    if by_offsets is None:
        by_offsets = sizes[idx.fqn] = {tuple(c.offsets): tuple(c.sizes) for c in item.chunks}
    return fmt.KIND_TENSOR, fmt.dtype_name(item.properties.dtype), by_offsets.get(tuple(idx.offset or ()))


def _check_shard(storage: CheckpointStorage, rel: str, records: list[MetadataIndex], md: Metadata,
                 report: VerifyReport, bar: Progress) -> None:
    """One shard file, opened as every reader opens it (reading/shard.py: present, of this save), every entry of
    its header checked against the file and the metadata, and every checksum."""
    before = len(report.problems)
    full = storage.full(rel)
    save_id = getattr(md.storage_meta, "save_id", None)
    try:
        f = open_named(storage, rel, save_id)
    except CheckpointError as e:
        names = ", ".join(sorted(_label(i) for i in records)[:5]) + (", ..." if len(records) > 5 else "")
        lost = f"; {count(len(records), 'entry')} lost ({names})" if isinstance(e, IncompleteCheckpointError) else ""
        report.problems.append(dataclasses.replace(Problem.of(e, full), message=e.message + lost))
        return
    with f:
        try:
            shard = shard_of(f, file_save_id(save_id, rel), stock=False, check_entries=True,
                             referenced=rel.startswith("../"))
        except CheckpointError as e:
            report.problems.append(Problem.of(e, full))
            return
        assert shard is not None
        _check_entries(shard, full, rel, records, md, report, bar, before)


def _check_entries(shard: Shard, full: str, rel: str, records: list[MetadataIndex], md: Metadata,
                   report: VerifyReport, bar: Progress, before: int) -> None:
    used, keys, sizes = set(), shard.header.by_key(), {}  # type: ignore[var-annotated]
    for idx in records:
        kind, dtype, shape = _expect(md, idx, sizes)
        info = md.storage_data[idx]
        e = keys.get((idx.fqn, None if kind == fmt.KIND_BYTES else tuple(idx.offset or ())))
        if e is None:
            report.problems.append(Problem(full, _label(idx), "metadata names this entry but the shard header lacks it",
                                           "FormatError"))
            continue
        used.add(e.key)
        diffs = []
        if (info.offset, info.length) != (e.offset, e.length):
            diffs.append(f"metadata says bytes [{info.offset}, +{info.length}), header says [{e.offset}, +{e.length})")
        encoded_as = None if e.kind != fmt.KIND_ENCODED else (fmt.KIND_BYTES if e.chunk_offsets is None
                                                               else fmt.KIND_TENSOR)
        if (encoded_as or e.kind) != kind:
            diffs.append(f"metadata says {kind}, header says {e.kind}")
        elif list(getattr(info, "transform_descriptors", None) or ()) != list(e.transforms):
            diffs.append(f"metadata says stream transforms {list(info.transform_descriptors or ())}, "
                         f"header says {list(e.transforms)}")
        elif kind == fmt.KIND_TENSOR and (e.dtype != dtype or e.shape != shape):
            diffs.append(f"metadata says {dtype} {list(shape or ())}, header says {e.dtype} {list(e.shape)}")
        report.problems.extend(Problem(full, e.label, d, "FormatError") for d in diffs)
    for e in shard.header.entries:
        try:
            shard.verify(e)
            if e.kind == fmt.KIND_ENCODED:
                _check_decodes(shard, e, report)
        except CheckpointError as err:
            report.problems.append(Problem.of(err, full))
        bar.advance(e.length)
        report.bytes_checked += e.length
        if e.key not in used and not rel.startswith("../"):  # a sibling step's shard holds its own entries too
            report.notes.append(f"{full}: header entry {e.label!r} is not referenced by the metadata (unused)")
    try:
        check_size_unchanged(shard)
    except CheckpointError as err:
        report.problems.append(Problem.of(err, full))
    if len(report.problems) == before:
        report.checked.append(f"{rel}: preamble and header valid (format {fmt.FORMAT_MAJOR}.{shard.header.minor}, "
                              f"{count(len(shard.header.entries), 'entry')} in bounds, aligned, not overlapping); "
                              f"matches the metadata; {count(len(shard.header.entries), 'checksum')} "
                              f"match{'es' * (len(shard.header.entries) == 1)} "
                              f"({human_bytes(sum(e.length for e in shard.header.entries))})")


def _check_decodes(shard: Shard, e: fmt.Entry, report: VerifyReport) -> None:
    """An encoded entry must decode (through DCP's default transforms) to its value's length."""
    try:
        decode_entry(shard, e, StreamTransforms())
    except FormatError:
        raise
    except CheckpointError:  # a transform of the user's own: only dcp.load with its registry can undo it
        report.notes.append(f"{shard.path}: entry {e.label!r} went through stream transforms {list(e.transforms)} "
                            "that DCP's default registry does not know; its stored bytes were checked, not decoded")


_COMMITS = (".metadata", "__*.metadata")
_SHARD = re.compile(r"^__\d+_\d+(\.[0-9a-f]{8})?\.distcp$")
_TEMP = re.compile(r"^\..*\.tmp-[0-9a-z-]+$")


def _why_unreferenced(name: str) -> str:
    if _SHARD.match(name):
        return "not referenced by the metadata: shard file left over by an earlier save (safe to delete)"
    if _TEMP.match(name):
        return "not referenced by the metadata: temporary file of an unfinished write (safe to delete)"
    return "not referenced by the metadata: not part of the checkpoint (kept; verify did not check it)"


def _check_directory(storage: CheckpointStorage, p: str, url: bool, referenced: set[str],
                     report: VerifyReport) -> None:
    """Every regular file that is neither a commit (metadata) file nor referenced is a warning with its size
    (at a URL: every file the storage lists that opens)."""
    for name in sorted(storage.list() if url else os.listdir(p)):
        if name in referenced or any(fnmatch.fnmatchcase(name, c) for c in _COMMITS):
            continue
        if url:
            try:
                with storage.open_file(name) as f:
                    report.warnings.append(FileWarning(f.path, f.size, _why_unreferenced(name)))
            except CheckpointError:
                pass  # gone meanwhile, or no file (an upload in progress)
            continue
        full = os.path.join(p, name)
        try:
            st = os.lstat(full)
        except OSError:
            continue
        if os.path.isfile(full) and not os.path.islink(full):
            report.warnings.append(FileWarning(full, st.st_size, _why_unreferenced(name)))
