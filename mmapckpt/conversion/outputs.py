"""Where a conversion's files go: a new version of its destination (storage/replacement.py), on any medium.

What every sink shares: a tensor's bytes (:func:`raw_bytes`), a data file written through a
``FileOutput`` (:func:`write_stored`: it appears under its name only once complete, and any
failure aborts it), new names that take no name already there (:func:`fresh_name`), which files
an old checkpoint owns (:func:`owned_files`), and the files of a Hugging Face directory that go
with its weights (:func:`copy_side_files`).
"""

from __future__ import annotations

import fnmatch
import os
from collections.abc import Callable, Collection, Iterable
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ..errors import CheckpointWriteError
from ..storage.base import CheckpointStorage, FileOutput
from ..reading.formats import owned_files as format_owned_files
from ..storage.replacement import Replacement
from .common import Writing

__all__ = ["Put", "Appending", "raw_bytes", "nbytes", "fresh_name", "write_stored", "checkpoint_files",
           "owned_files", "is_commit_file", "HF_SIDE_FILES", "copy_side_files"]

#: Where tensor bytes go: ``put(offset, data)`` (a ``pwrite`` into a local file, a ``FileOutput.put``).
Put = Callable[[int, Any], None]


def raw_bytes(t: torch.Tensor) -> memoryview:
    """The tensor's bytes in C order; no copy where it is already contiguous on the CPU."""
    flat = t.detach().cpu().resolve_conj().resolve_neg().contiguous().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    if flat.stride(0) != 1:  # one element counts as contiguous whatever its stride
        flat = flat.clone(memory_format=torch.contiguous_format)
    return memoryview(flat.view(torch.uint8).numpy())


def nbytes(md: TensorStorageMetadata) -> int:
    n = 1
    for s in md.size:
        n *= s
    return n * md.properties.dtype.itemsize


def fresh_name(rel: str, save_id: str, avoid: Collection[str]) -> str:
    """``rel``, or, where a file of that name is there (``avoid``), ``rel`` with the save id in it (as a save
    names a shard whose name is taken: storage/commits.py ``shard_name``), so no file a committed checkpoint
    references is overwritten before the new commit."""
    if rel not in avoid:
        return rel
    stem, dot, ext = rel.rpartition(".")
    tag = save_id.replace("-", "")[:8]
    name = f"{stem}.{tag}.{ext}" if dot and stem else f"{rel}.{tag}"
    if name in avoid:
        raise CheckpointWriteError("no free file name (both candidates exist)", path=name)
    return name


class Appending:
    """A write-only file for ``torch.save`` whose bytes go to a ``FileOutput`` at ascending offsets."""

    def __init__(self, out: FileOutput) -> None:
        self.out, self.pos = out, 0

    def write(self, b: Any) -> int:
        n = memoryview(b).nbytes
        if n:
            self.out.put(self.pos, b)
            self.pos += n
        return n

    def tell(self) -> int:
        return self.pos

    def flush(self) -> None:
        pass


def write_stored(storage: CheckpointStorage, name: str, size: int | None, head: int,
                 body: Callable[[FileOutput, Writing], bytes | None]) -> None:
    """File ``name`` of ``storage`` written by ``body(output, writing)``, which returns its first ``head`` bytes
    (written last); any failure aborts it (nothing appears under the name) and is named as ``Writing`` names it."""
    out = storage.create_file(name, size, head=head, direct=False, sync=True)
    try:
        with Writing(out.path) as w:
            first = body(out, w)
            out.finish(first or b"")
    except BaseException:
        out.abort()
        raise


def checkpoint_files(names: Iterable[str], read: Callable[[str], bytes]) -> set[str]:
    """Which of ``names`` (the files of a directory) belong to a checkpoint there: the format table's ``owns``
    (reading/formats.py ``owned_files``); ``read(name)`` gives an index's bytes (an unreadable index names nothing).

    DCP (mmapckpt or stock): ``.metadata``, ``__*.metadata``, ``__*_*.distcp`` and their writers'
    temp files. Hugging Face safetensors: every ``*.safetensors.index.json``, the files their
    ``weight_map`` names, ``model.safetensors`` and ``model-NNNNN-of-NNNNN.safetensors`` (also with the
    tag a conversion at a URL gives a shard whose name was taken: ``model-NNNNN-of-NNNNN.TAG.safetensors``).
    """
    return format_owned_files(names, read)


def owned_files(storage: CheckpointStorage) -> set[str]:
    """The files of the checkpoint at ``storage`` (:func:`checkpoint_files`), which a new version replaces."""
    return checkpoint_files(storage.list(), lambda n: bytes(storage.read_file(n, _MAX_INDEX)))


#: The largest index read to learn which files an old checkpoint owns.
_MAX_INDEX = 64 << 20


def is_commit_file(name: str) -> bool:
    """Whether ``name`` is a file that makes a directory a checkpoint (its metadata, an index)."""
    return fnmatch.fnmatchcase(name, ".metadata") or fnmatch.fnmatchcase(name, "__*.metadata") or \
        name.endswith(".safetensors.index.json")


#: The files of a Hugging Face model directory that go with its weights: a conversion from one Hugging Face
#: directory to another copies those the source has (what ``from_pretrained`` and tokenizers read).
HF_SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json", "added_tokens.json", "tokenizer.model", "vocab.txt", "vocab.json",
                 "merges.txt", "spiece.model", "sentencepiece.bpe.model", "chat_template.jinja",
                 "chat_template.json", "preprocessor_config.json", "processor_config.json")


def copy_side_files(src_dir: str, out: Replacement) -> list[str]:
    """Write the :data:`HF_SIDE_FILES` that are regular files in the local directory ``src_dir`` into the new
    version ``out`` (each through a ``FileOutput``, durable); returns their names."""
    copied = []
    for name in HF_SIDE_FILES:
        src = os.path.join(src_dir, name)
        if not os.path.isfile(src):  # a link to a file counts: hub snapshots link every file into blobs/
            continue
        with open(src, "rb") as f:
            data = f.read()

        def body(o: FileOutput, w: Writing, data: bytes = data) -> bytes:
            if data:
                o.put(0, data)
            return b""

        write_stored(out.storage, name, len(data), 0, body)
        if name not in out.avoid:  # one written over in place is not removed again by a failure
            out.add(name)
        copied.append(name)
    return copied
