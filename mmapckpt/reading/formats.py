"""The one table of checkpoint formats: every format declares here, once, how a place is recognised as
holding it, how it is opened for reading, its DCP metadata, the files it owns, its extensions and how
it is written. Every reader and writer asks this table (as fsspec's ``known_implementations`` is asked
for file systems); no other module compares format names.

A record's ``family`` is the name users see (``open(...).kind``, ``inspect``, ``convert(to=)``): one
of :data:`FORMATS`. Several records share a family (a safetensors file, a Hugging Face directory of
them and a directory of loose safetensors files are all ``"safetensors"``). The DCP metadata and the
sink live in wings above this one (dcp/, conversion/): a record names them (``"module:attribute"``)
and :meth:`Format.resolved` imports them on first use.

Recognition (:func:`recognise`) tries the records in :data:`TABLE`'s order; the first that claims
the place wins. A directory is asked for its names once (:class:`Probe`), so an object store answers
one LIST, not one request per record.
"""

from __future__ import annotations

import fnmatch
import importlib
import json
import os
import re
from collections.abc import Callable, Iterable
from typing import Any

from ..errors import CheckpointNotFoundError
from ..format.metadata import KIND_MMAPCKPT, METADATA_NAME
from ..storage.hub import hub_snapshot, is_hub_repository
from .families import FORMATS
from .hf_dirs import (SAFETENSORS_INDEX, SAFETENSORS_SINGLE, SAFETENSORS_SUFFIX, TORCH_INDEX, TORCH_SINGLE, Files,
                      index_name, indexed_files)
from ..storage.location import storage_for
from .located import Place
from .opened import Opened, open_dcp, open_safetensors, open_torch

__all__ = ["FORMATS", "TABLE", "Format", "Probe", "by_name", "family", "recognise", "resolve", "target_family",
           "owned_files", "DEFAULT_TARGET", "STOCK_READER_NOTE"]

#: What ``convert`` writes where the destination's extension names no format: a directory.
DEFAULT_TARGET = "mmapckpt"


class Probe:
    """What recognition asks of a place, each asked once: its directory's names, the commit's kind, a
    file's first bytes."""

    def __init__(self, place: Place) -> None:
        self.place = place
        self._names: set[str] | None = None
        self._kind: str | None = None
        self._commit: bool | None = None

    @property
    def is_dir(self) -> bool:
        return self.place.is_dir

    def names(self) -> set[str]:
        if self._names is None:
            self._names = set(self.place.storage.list())
        return self._names

    def has(self, name: str) -> bool:
        """Whether the directory holds file ``name`` (a regular file, where the medium tells). At a URL the commit
        is looked up by its name, not in a listing: the look is the request that reads its first bytes, which a
        load of the checkpoint reads next (listing an object store's prefix takes two requests on S3: its objects
        and its uploads in progress)."""
        if name == METADATA_NAME and not self.place.local and self._names is None:
            if self._commit is None:
                self._commit = self.place.exists(name)
            return self._commit
        return name in self.names() and self.place.exists(name)

    def commit_kind(self) -> str | None:
        """``"mmapckpt"`` or ``"dcp"`` for a directory with a ``.metadata``, else None."""
        if not self.is_dir or not self.has(METADATA_NAME):
            return None
        if self._kind is None:
            self._kind = self.place.storage.commit_kind(METADATA_NAME)
        return self._kind

    def hf_kind(self) -> str | None:
        """``"safetensors"`` or ``"torch"`` for a Hugging Face model directory (an index or the one file;
        safetensors weights win where it holds both, as ``transformers`` picks them), else None."""
        if not self.is_dir or self.has(METADATA_NAME):
            return None
        if index_name(self.place.storage, "safetensors") is not None or self.has(SAFETENSORS_SINGLE):
            return "safetensors"
        if index_name(self.place.storage, "torch") is not None or self.has(TORCH_SINGLE):
            return "torch"
        return None


class Format:
    """One format's record.

    Attributes:
        name: the record's name (``"hf-safetensors"``).
        family: one of :data:`FORMATS` ("" for a record that only resolves to another place).
        what: the format in words, for messages.
        recognise: whether a place (through its :class:`Probe`) holds this format.
        files: which files of the place hold it (``{name: the tensors an index puts there, or None}``); None
            for a DCP directory, whose metadata names them.
        opener: opens it for reading: ``(place, files, verify) -> Opened`` (reading/opened.py), the backend
            every reader reads through.
        dcp_metadata: ``"module:function"``: ``(storage, path, rank) -> (kind, Metadata)``, the DCP metadata
            ``MmapReader`` plans over; None where ``dcp.load`` cannot read the format.
        resolve: for a place that only leads to a checkpoint (a hub cache repository): the place it names.
        extensions: a destination ending in one is written in this family (the first record of a family
            with extensions owns them).
        owns: patterns (``fnmatch``) of the names a checkpoint of this format owns in its directory (what
            ``convert --overwrite`` replaces; never config files, adapters or notes).
        sink: ``"module:function"`` writing this family (conversion/); None for records only read. Every sink has
            one signature: ``(source, out, job) -> (entries left out, the commit's name)`` (conversion/common.py
            ``SinkJob``).
        directory: whether the family is written as a directory.
        shards: whether it takes ``max_shard_size`` (Hugging Face shards and their index, a directory).
        dir_file: where a file format is written into a destination that is a directory (``model.safetensors``);
            None where it is written only as a file named by the destination.
        drops: why its sink leaves some non-tensor entries out (for the warning); "" where it keeps them all.
        user_metadata: whether it holds the user metadata ({str: str}).
        scratch: whether it is assembled in a local scratch file first and written from it (its sink names its
            own progress phases, and the bytes count twice).
        note: what a user of this format should know (``inspect`` prints it).
        checks: ``"module:function"``: ``(place, record, report, progress)``, the checks ``verify`` makes of this
            format (tools/); None for records only resolved.
        version: ``(opened, index) -> str``: the version of a checkpoint of flat files, in words.
    """

    # a plain class with slots, not a dataclass: building a dataclass of these fields costs about a millisecond of
    # every new process's first load
    __slots__ = ("name", "family", "what", "recognise", "opener", "files", "dcp_metadata", "resolve", "extensions",
                 "owns", "sink", "directory", "shards", "dir_file", "drops", "user_metadata", "scratch", "note",
                 "checks", "version")

    def __init__(self, name: str, family: str, what: str, recognise: Callable[[Probe], bool],
                 opener: Callable[[Place, Files | None, bool], Opened] | None = None,
                 files: Callable[[Place], tuple[Files, str | None]] | None = None, dcp_metadata: str | None = None,
                 resolve: Callable[[Place], Place] | None = None, extensions: tuple[str, ...] = (),
                 owns: tuple[str, ...] = (), sink: str | None = None, directory: bool = False, shards: bool = False,
                 dir_file: str | None = None, drops: str = "", user_metadata: bool = False, scratch: bool = False,
                 note: str = "", checks: str | None = None,
                 version: Callable[[Opened, str | None], str] | None = None) -> None:
        self.name, self.family, self.what, self.recognise = name, family, what, recognise
        self.opener, self.files, self.dcp_metadata, self.resolve = opener, files, dcp_metadata, resolve
        self.extensions, self.owns, self.sink, self.directory, self.shards = extensions, owns, sink, directory, shards
        self.dir_file, self.drops, self.user_metadata, self.scratch = dir_file, drops, user_metadata, scratch
        self.note, self.checks, self.version = note, checks, version

    def __repr__(self) -> str:
        return f"Format({self.name!r})"

    def resolved(self, attribute: str) -> Any:
        """The object ``attribute`` (``"dcp_metadata"``, ``"sink"``) names, imported."""
        ref = getattr(self, attribute)
        if ref is None:
            raise LookupError(f"the {self.what} format has no {attribute}")
        module, _, name = ref.partition(":")
        return getattr(importlib.import_module(module), name)

    def open(self, place: Place, *, verify: bool = False) -> Opened:
        """The checkpoint at ``place`` opened for lazy reading."""
        assert self.opener is not None, self.name
        files = None if self.files is None else self.files(place)[0]
        return self.opener(place, files, verify)


def _hub_snapshot(place: Place) -> Place:
    snap = hub_snapshot(place.path)
    assert snap is not None
    return Place(snap, storage_for(snap), None, True)


def _safetensors_dir_files(place: Place) -> tuple[Files, str | None]:
    return indexed_files(place, "safetensors", listing=True)


def _is_safetensors_file(p: Probe) -> bool:
    if p.is_dir:
        return False
    if p.place.name.endswith(SAFETENSORS_SUFFIX):  # type: ignore[union-attr]
        return True
    from .safetensors_files import is_safetensors_file  # each backend is imported by the loads of its format

    with p.place.open() as f:
        return is_safetensors_file(f)


def _torch_version(opened: Opened, index: str | None) -> str:
    from .torchfile import is_zip

    place = opened.place
    assert place is not None
    with place.open(next(iter(opened.layout or ()))) as f:
        kind = "torch.save zip archive" if is_zip(f) else "torch.save legacy format"
    n = len(opened.layout or ())
    return kind if not place.is_dir else \
        f"{kind}: pytorch_model.bin in a directory" if index is None else f"{kind}: {n} shards with index"


def _safetensors_version(single: str) -> Callable[[Opened, str | None], str]:
    def version(opened: Opened, index: str | None) -> str:
        place, n = opened.place, len(opened.layout or ())
        assert place is not None
        if not place.is_dir:
            return "single file"
        if index is not None:
            return f"{n} shards with index"
        return single or f"{n} file{'s' * (n != 1)} without an index"
    return version


def _is_torch_file(p: Probe) -> bool:
    if p.is_dir:
        return False
    from .torchfile import is_torch_file

    with p.place.open() as f:
        return is_torch_file(f)


#: A DCP checkpoint's own files (mmapckpt and stock alike), with the temp files of its writers.
_DCP_FILES = (".metadata", "__*.metadata", "__*_*.distcp", "..metadata.tmp-*", ".__*.metadata.tmp-*",
              ".__*_*.distcp.tmp-*")
#: A Hugging Face safetensors checkpoint's own files, besides those its index names (a shard tagged as a
#: conversion at a URL tags one whose name was taken: model-NNNNN-of-NNNNN.TAG.safetensors).
_HF_FILES = ("*.safetensors.index.json", ".*.safetensors.index.json.tmp-*", SAFETENSORS_SINGLE,
             "re:^model-\\d{5}-of-\\d{5}(\\.[0-9a-f]{8})?\\.safetensors$")

#: What a user of the stock reader needs to know (its error on this format is "invalid load key, '\xff'").
STOCK_READER_NOTE = ("note: the stock DCP reader (dcp.load without storage_reader, or FileSystemReader) cannot read "
                     "this format: load it with storage_reader=mmapckpt.MmapReader(path), or make a stock copy "
                     "with `mmapckpt convert SRC DST --to dcp`")

_CHECK_SAFETENSORS = "mmapckpt.tools.verify_flat:verify_safetensors"
_CHECK_TORCH = "mmapckpt.tools.verify_flat:verify_torch_files"

#: The table, in recognition order.
TABLE: tuple[Format, ...] = (
    Format("mmapckpt", "mmapckpt", "mmapckpt checkpoint directory", lambda p: p.commit_kind() == KIND_MMAPCKPT,
           open_dcp, dcp_metadata="mmapckpt.dcp.reader:committed_metadata", owns=_DCP_FILES,
           sink="mmapckpt.conversion.sinks:write_mmapckpt", directory=True, user_metadata=True,
           note=STOCK_READER_NOTE, checks="mmapckpt.tools.verify:verify_mmapckpt"),
    Format("dcp", "dcp", "stock DCP checkpoint directory (torch.save items, or SAFETENSORS serialization: one "
           "backend reads both, by each shard's first bytes)", lambda p: p.commit_kind() == "dcp",
           open_dcp, dcp_metadata="mmapckpt.dcp.reader:committed_metadata", owns=_DCP_FILES,
           sink="mmapckpt.conversion.sinks:write_dcp", directory=True, checks="mmapckpt.tools.verify:verify_stock"),
    Format("hub-cache", "", "Hugging Face hub cache repository (its refs/main snapshot)",
           lambda p: p.is_dir and p.place.local and is_hub_repository(p.place.path), resolve=_hub_snapshot),
    Format("hf-safetensors", "safetensors", "Hugging Face directory of safetensors files",
           lambda p: p.hf_kind() == "safetensors", open_safetensors, _safetensors_dir_files,
           dcp_metadata="mmapckpt.dcp.safetensors_metadata:hf_metadata", owns=_HF_FILES,
           version=_safetensors_version("model.safetensors in a directory"), checks=_CHECK_SAFETENSORS),
    Format("hf-bin", "torch", "Hugging Face directory of torch.save files (pytorch_model.bin)",
           lambda p: p.hf_kind() == "torch", open_torch, lambda place: indexed_files(place, "torch"),
           version=_torch_version, checks=_CHECK_TORCH),
    Format("safetensors-dir", "safetensors", "directory of safetensors files without an index (a PEFT adapter; "
           "HuggingFaceStorageWriter output)",
           lambda p: p.is_dir and not p.has(METADATA_NAME) and any(n.endswith(SAFETENSORS_SUFFIX) for n in p.names()),
           open_safetensors, _safetensors_dir_files,
           dcp_metadata="mmapckpt.dcp.safetensors_metadata:hf_metadata", version=_safetensors_version(""),
           checks=_CHECK_SAFETENSORS),
    Format("safetensors-file", "safetensors", "safetensors file", _is_safetensors_file, open_safetensors,
           lambda place: indexed_files(place, "safetensors"), extensions=(".safetensors",),
           sink="mmapckpt.conversion.flat_sinks:write_safetensors", shards=True, dir_file=SAFETENSORS_SINGLE,
           drops="safetensors holds only tensors", user_metadata=True, version=_safetensors_version(""),
           checks=_CHECK_SAFETENSORS),
    Format("torch-file", "torch", "torch.save file", _is_torch_file, open_torch,
           lambda place: indexed_files(place, "torch"), extensions=(".pt", ".pth", ".bin"),
           sink="mmapckpt.conversion.flat_sinks:write_torch", drops="they cannot be unpickled safely "
           "(weights_only=True)", scratch=True, version=_torch_version, checks=_CHECK_TORCH),
)

_BY_NAME = {f.name: f for f in TABLE}
assert all(f.family in FORMATS or f.resolve is not None for f in TABLE)


def by_name(name: str) -> Format:
    """The record called ``name``."""
    return _BY_NAME[name]


def family(name: str) -> Format:
    """The record that writes family ``name`` (one of :data:`FORMATS`)."""
    for f in TABLE:
        if f.family == name and f.sink is not None:
            return f
    raise ValueError(f"unknown format {name!r}; choose one of {', '.join(FORMATS)}")


def target_family(dst: str | os.PathLike[str]) -> str:
    """The family ``convert`` writes at ``dst`` when ``to`` is not given: the one whose extension ``dst`` has
    (``.safetensors``; ``.pt``, ``.pth``, ``.bin``), else :data:`DEFAULT_TARGET` (a directory)."""
    name = os.fspath(dst).rstrip("/" + os.sep)
    ext = os.path.splitext(name)[1].lower()
    return next((f.family for f in TABLE if ext in f.extensions), DEFAULT_TARGET)


def resolve(place: Place) -> Place:
    """``place``, or the place a record's ``resolve`` makes of it (a hub cache repository: its snapshot)."""
    probe = Probe(place)
    for f in TABLE:
        if f.resolve is not None and f.recognise(probe):
            return f.resolve(place)
    return place


_EXPECTED = (f"no checkpoint here: no {METADATA_NAME} (mmapckpt or DCP), {SAFETENSORS_INDEX}, {SAFETENSORS_SINGLE}, "
             f"{TORCH_INDEX}, {TORCH_SINGLE} or *.safetensors file")


def recognise(place: Place) -> Format:
    """The record of the checkpoint at ``place`` (resolved: see :func:`resolve`).

    Raises:
        CheckpointNotFoundError: nothing recognisable.
        IncompleteCheckpointError: DCP shards without committed metadata.
    """
    probe = Probe(place)
    for f in TABLE:
        if f.resolve is None and f.recognise(probe):
            return f
    if place.is_dir:
        try:
            place.storage.find_metadata()  # raises IncompleteCheckpointError (shards without a commit) or:
        except CheckpointNotFoundError:
            pass
        raise CheckpointNotFoundError(_EXPECTED, path=place.path)
    raise CheckpointNotFoundError("not a recognised checkpoint (mmapckpt, DCP, safetensors or torch.save)",
                                  path=place.path)


def _matches(name: str, pattern: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return fnmatch.fnmatchcase(name, pattern)


def owned_files(names: Iterable[str], read: Callable[[str], bytes]) -> set[str]:
    """Which of ``names`` (the files of a directory) belong to a checkpoint there, by every record's ``owns``;
    ``read(name)`` gives an index's bytes: the files its ``weight_map`` names are owned too (an unreadable index
    names nothing)."""
    names = set(names)
    patterns = [p for f in TABLE for p in f.owns]
    owned = {n for n in names if any(_matches(n, p) for p in patterns)}
    for idx in [n for n in owned if n.endswith(".safetensors.index.json")]:
        try:
            wm = json.loads(read(idx)).get("weight_map", {})
            owned |= {v for v in wm.values() if isinstance(v, str) and v in names}
        except Exception:  # noqa: BLE001 - an unreadable index names nothing; the file itself is still replaced
            pass
    return owned
