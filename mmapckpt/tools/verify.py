"""``mmapckpt verify``: check a checkpoint completely and report every problem.

The checkpoint is found by the format table (reading/formats.py), whose record names the checks its format
allows (``Format.checks``), and every file is read through the storage (local or at a URL alike).

An mmapckpt checkpoint, in order: the metadata is present, committed and decodes (the decoder checks
that every chunk and non-tensor entry has a storage record and that chunks tile their tensor); every
shard file it names is opened as every reader opens it (reading/shard.py: present, of this save),
with a valid preamble and header whose entries lie in bounds, aligned and without overlaps; every
storage record matches a header entry (same offset, length, kind, dtype and chunk shape); the
CRC-32 of every entry's bytes matches. It works on the format's own index (dtype names): no torch is
imported but to decode entries stored through stream transforms.

A stock DCP checkpoint has no checksums: it is opened as every reader opens it (reading/chunks.py
``ChunkFiles``: every data file present and reaching the end of its last record), then every tensor
item is loaded the way a load reads it (``torch.load(weights_only=True)``, or found by name in a
SAFETENSORS-format shard's safetensors data and checked against the metadata) and every non-tensor
item's bytes are read (not unpickled: that could run code).

Flat files get the checks their format allows (tools/verify_flat.py). Problems are collected, never raised
one at a time, so one run shows them all. Files in a DCP directory that no metadata references (left-over
shards, temp files, files of other programs such as config.json) are listed with their sizes as warnings:
they do not make the checkpoint unsound.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import os
import re
from collections.abc import Mapping
from typing import Any

from ..conversion.progress import Progress, human_bytes
from ..errors import CheckpointError, CheckpointNotFoundError, FormatError, IncompleteCheckpointError
from ..format import layout as fmt
from ..format.entries import EntryInfo
from ..format.metadata import KIND_MMAPCKPT, METADATA_NAME, MetaIndex, decode_index, decode_user_metadata
from ..format.transforms import StreamTransforms
from ..reading.formats import Format, recognise, resolve
from ..reading.located import Place, locate
from ..reading.shard import Shard, check_size_unchanged, decode_entry, file_save_id, open_named, shard_of
from ..storage.base import CheckpointStorage
from ..storage.location import is_url, storage_for
from .verify_report import FileWarning, Problem, VerifyReport
from .wording import count

__all__ = ["Problem", "FileWarning", "VerifyReport", "verify_checkpoint", "verify_mmapckpt", "verify_stock"]

#: A storage record as the index places it: (key, kind, dtype name, chunk shape, file offset, length, transforms).
_Record = tuple[tuple[str, "tuple[int, ...] | None"], str, "str | None", "tuple[int, ...] | None", int, int,
                tuple[str, ...]]


def verify_checkpoint(path: str | os.PathLike[str], *, progress: bool = False,
                      storage_options: Mapping[str, Any] | None = None) -> VerifyReport:
    """Check the checkpoint at ``path``; return every problem found.

    For an mmapckpt checkpoint, reads every byte of every entry (to check its CRC-32); a stock DCP
    checkpoint has every item loaded as a load reads it. A safetensors file or Hugging Face
    directory, or a torch.save file, gets the checks its format allows (see the module's docstring;
    ``report.checked`` and ``report.notes`` say which). The checkpoint is sound when ``report.ok``.

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
    record = _record(place) if place is not None else None
    if record is not None:
        record.resolved("checks")(place, record, report, progress)
        return report
    storage = place.storage if place is not None and place.is_dir else storage_for(p, options=storage_options)
    verify_mmapckpt(Place(p, storage, None, not is_url(p)), None, report, progress)  # reports what is missing
    return report


def _record(place: Place) -> Format | None:
    """The format table's record of the checkpoint at ``place``; None where it holds none that the table
    recognises (the metadata check then reports what is missing)."""
    try:
        return recognise(place)
    except CheckpointError:
        return None


# --------------------------------------------------------------------------- mmapckpt
def verify_mmapckpt(place: Place, record: Format | None, report: VerifyReport, progress: bool) -> None:
    """The checks of an mmapckpt checkpoint directory (the module docstring)."""
    storage = place.storage
    ix = _check_metadata(storage, report)
    if ix is None:
        return
    per_file = _records_by_file(ix)
    total = sum(r[5] for records in per_file.values() for r in records)
    with Progress(total, "verify", enabled=progress) as bar:
        for rel in sorted(per_file):
            _check_shard(storage, rel, per_file[rel], ix.save_id, report, bar)
    _check_directory(storage, set(per_file), report)


def _check_metadata(storage: CheckpointStorage, report: VerifyReport) -> MetaIndex | None:
    try:
        commit = storage.read_commit()
        if commit.kind != KIND_MMAPCKPT:  # the table recognised none: a commit it does not know
            raise FormatError("not an mmapckpt commit", path=commit.full)
        ix = decode_index(commit.data, commit.full)  # shapes, chunk tiling, records and stored ranges checked
        decode_user_metadata(commit.kind, commit.data, commit.full)  # {str: str} or absent, as convert demands
    except CheckpointError as e:
        report.problems.append(Problem.of(e, storage.location))
        return None
    files = {c.file for e in ix.entries.values() for c in e.chunks}
    records = sum(len(e.chunks) for e in ix.entries.values())
    report.checked.append(f"metadata {commit.full}: committed, decodes, checksum matches; "
                          f"{count(len(ix.entries), 'entry')}, {count(records, 'storage record')} "
                          f"in {count(len(files), 'shard file')}")
    report.checked.append("metadata: every chunk and non-tensor entry has a storage record; chunks tile every tensor "
                          "exactly, stored byte ranges shared only by tied weights (checked as it decoded)")
    return ix


def _records_by_file(ix: MetaIndex) -> dict[str, list[_Record]]:
    out: dict[str, list[_Record]] = {}
    for e in ix.entries.values():
        for c in e.chunks:
            key = (e.name, None) if e.kind != "tensor" else (e.name, c.offsets)
            kind = fmt.KIND_BYTES if e.kind != "tensor" else fmt.KIND_TENSOR
            out.setdefault(c.file, []).append((key, kind, e.dtype_name, c.sizes if e.kind == "tensor" else None,
                                               c.file_offset, c.length, tuple(ix.transforms.get(key, ()))))
    return out


def _label(key: tuple[str, tuple[int, ...] | None]) -> str:
    return key[0] if key[1] is None else f"{key[0]}@{list(key[1])}"


def _check_shard(storage: CheckpointStorage, rel: str, records: list[_Record], save_id: str | None,
                 report: VerifyReport, bar: Progress) -> None:
    """One shard file, opened as every reader opens it (reading/shard.py: present, of this save), every entry of
    its header checked against the file and the metadata, and every checksum."""
    before = len(report.problems)
    full = storage.full(rel)
    try:
        f = open_named(storage, rel, save_id)
    except CheckpointError as e:
        names = ", ".join(sorted(_label(r[0]) for r in records)[:5]) + (", ..." if len(records) > 5 else "")
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
        _check_entries(shard, full, rel, records, report, bar, before)


def _differences(r: _Record, e: fmt.Entry) -> list[str]:
    _, kind, dtype, shape, offset, length, transforms = r
    diffs = []
    if (offset, length) != (e.offset, e.length):
        diffs.append(f"metadata says bytes [{offset}, +{length}), header says [{e.offset}, +{e.length})")
    encoded_as = None if e.kind != fmt.KIND_ENCODED else (fmt.KIND_BYTES if e.chunk_offsets is None
                                                           else fmt.KIND_TENSOR)
    if (encoded_as or e.kind) != kind:
        diffs.append(f"metadata says {kind}, header says {e.kind}")
    elif list(transforms) != list(e.transforms):
        diffs.append(f"metadata says stream transforms {list(transforms)}, header says {list(e.transforms)}")
    elif kind == fmt.KIND_TENSOR and (e.dtype != dtype or e.shape != shape):
        diffs.append(f"metadata says {dtype} {list(shape or ())}, header says {e.dtype} {list(e.shape)}")
    return diffs


def _check_entries(shard: Shard, full: str, rel: str, records: list[_Record], report: VerifyReport, bar: Progress,
                   before: int) -> None:
    used, keys = set(), shard.header.by_key()
    for r in records:
        e = keys.get(r[0])
        if e is None:
            report.problems.append(Problem(full, _label(r[0]), "metadata names this entry but the shard header "
                                                                "lacks it", "FormatError"))
            continue
        used.add(e.key)
        report.problems.extend(Problem(full, e.label, d, "FormatError") for d in _differences(r, e))
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
        n = len(shard.header.entries)
        report.checked.append(f"{rel}: preamble and header valid (format {fmt.FORMAT_MAJOR}.{shard.header.minor}, "
                              f"{count(n, 'entry')} in bounds, aligned, not overlapping); matches the metadata; "
                              f"{count(n, 'checksum')} match{'es' * (n == 1)} "
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


# --------------------------------------------------------------------------- stock DCP
def verify_stock(place: Place, record: Format, report: VerifyReport, progress: bool) -> None:
    """The checks of a stock DCP checkpoint directory (the module docstring)."""
    try:
        opened = record.open(place)  # every data file present, reaching its last record (as every reader opens it)
    except CheckpointError as e:
        report.problems.append(Problem.of(e, place.path))
        return
    files = opened.files
    try:
        names = {c.file for e in opened.entries.values() for c in e.chunks}
        report.checked.append(f"metadata {place.storage.full(METADATA_NAME)}: committed, unpickles with only DCP's "
                              f"classes, {count(len(opened.entries), 'entry')}; {count(len(names), 'data file')} "
                              "present, each reaching the end of its last record")
        total = sum(c.length for e in opened.entries.values() for c in e.chunks)
        before = len(report.problems)
        with Progress(total, "verify", enabled=progress) as bar:
            for e in opened.entries.values():
                _check_stock_entry(files, e, place, report, bar)
        if len(report.problems) == before:
            report.checked.append(f"every tensor item loads as a load reads it (torch.load(weights_only=True), or "
                                  f"its safetensors data found by name and matching the metadata); every "
                                  f"non-tensor item's bytes read ({human_bytes(total)})")
        report.notes.append("stock DCP checkpoints carry no checksums: damaged tensor bytes that still load cannot "
                            "be found (`mmapckpt convert SRC DST --to mmapckpt` makes a checkpoint with a CRC-32 "
                            "per entry); non-tensor items were read, not unpickled")
        _check_directory(place.storage, names, report)
    finally:
        files.close()


def _check_stock_entry(files: Any, e: EntryInfo, place: Place, report: VerifyReport, bar: Progress) -> None:
    for c in e.chunks:
        try:
            if e.kind == "tensor":
                files.chunk(e, c)
            else:
                files.object_bytes(e)
        except CheckpointError as err:
            report.problems.append(Problem.of(err, place.storage.full(c.file)))
        bar.advance(c.length)


# --------------------------------------------------------------------------- unreferenced files
_COMMITS = (".metadata", "__*.metadata")
_SHARD = re.compile(r"^__\d+_\d+(\.[0-9a-f]{8})?\.distcp$")
_TEMP = re.compile(r"^\..*\.tmp-[0-9a-z-]+$")


def _why_unreferenced(name: str) -> str:
    if _SHARD.match(name):
        return "not referenced by the metadata: shard file left over by an earlier save (safe to delete)"
    if _TEMP.match(name):
        return "not referenced by the metadata: temporary file of an unfinished write (safe to delete)"
    return "not referenced by the metadata: not part of the checkpoint (kept; verify did not check it)"


def _check_directory(storage: CheckpointStorage, referenced: set[str], report: VerifyReport) -> None:
    """Every file that is neither a commit (metadata) file nor referenced is a warning with its size: every name
    the storage lists that opens as a regular file."""
    for name in sorted(storage.list()):
        if name in referenced or any(fnmatch.fnmatchcase(name, c) for c in _COMMITS):
            continue
        try:
            with storage.open_file(name) as f:
                report.warnings.append(FileWarning(f.path, f.size, _why_unreferenced(name)))
        except CheckpointError:
            pass  # gone meanwhile, or no regular file (a directory, an upload in progress)
