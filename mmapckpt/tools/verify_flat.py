"""``mmapckpt verify`` of flat files: a safetensors file or directory of them, a torch.save file or Hugging Face
directory of them, opened by the format table's record (its ``files``: the index and every file it names) and
read by the backends' own pieces (reading/safetensors_files.py ``SafetensorsFile`` and reading/opened.py
``safetensors_union``: the header parser and the union rule every reader applies; reading/torchfile.py: the
one ``torch.load(weights_only=True)``), each file checked on its own, so that one run reports every problem.
"""

from __future__ import annotations

import zipfile
from typing import Any

from ..conversion.progress import Progress
from ..errors import CheckpointError
from ..format.safetensors import entry_infos
from ..reading.formats import Format
from ..reading.located import Place
from ..reading.opened import safetensors_union
from ..reading.safetensors_files import SafetensorsFile
from ..reading.torchfile import TorchSource, flat_torch_file, is_zip, torch_source
from .verify_report import Problem, VerifyReport
from .wording import count

__all__ = ["verify_safetensors", "verify_torch_files"]


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


def verify_safetensors(place: Place, fmt: Format, report: VerifyReport, progress: bool) -> None:
    """A safetensors file, or a directory of them: the index (every file present, every name in its file's header)
    and every header (dtypes known, shapes matching their byte ranges, data tiled to the end of the file), the
    files read together as every reader reads them; there are no checksums, so the data bytes cannot be
    checked."""
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


def verify_torch_files(place: Place, fmt: Format, report: VerifyReport, progress: bool) -> None:
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
