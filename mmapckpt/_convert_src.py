"""The read side of conversions: any supported checkpoint seen as DCP metadata plus readable items.

Every source, whatever its format, answers the same questions: its DCP ``Metadata``
(state_dict_metadata and planner_data; storage_data for DCP checkpoints), its file
layout (which items live in which file, in file order) and the bytes of one item at
a time. Non-DCP files (safetensors, torch.save) get the metadata ``dcp.save`` would
have written for them on one rank: one chunk per tensor, one file ``__0_0.distcp``.
Items are read one at a time, so a conversion never holds more than one of them.
"""

from __future__ import annotations

import io
import json
import os
import zipfile
from typing import Any, Iterator

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata

from . import format as fmt
from ._io import open_inside, pread_into
from ._shard import Shard
from ._stock import load_tensor
from .errors import CheckpointError, CheckpointNotFoundError, FormatError, IncompleteCheckpointError, TruncatedFileError
from .metafile import KIND_MMAPCKPT, METADATA_NAME, read_metadata_file
from .reader import find_metadata

__all__ = ["FORMATS", "SAFETENSORS_DTYPES", "SAFETENSORS_INDEX", "Source", "detect_format", "open_source",
           "label", "tensor_chunk_sizes"]

FORMATS = ("mmapckpt", "dcp", "safetensors", "torch")
SAFETENSORS_INDEX = "model.safetensors.index.json"
SINGLE_FILE = "__0_0.distcp"

#: safetensors dtype codes <-> torch dtypes, written out by hand (the safetensors spec's names).
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U64": torch.uint64, "U32": torch.uint32, "U16": torch.uint16, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "C64": torch.complex64,
}


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
    """

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

    def close(self) -> None:
        pass

    def __enter__(self) -> "Source":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --------------------------------------------------------------------------- DCP directories
class _DcpSource(Source):
    def __init__(self, path: str, kind: str, md: Metadata) -> None:
        self.path, self.kind, self.metadata = path, kind, md
        if md.storage_data is None:
            raise FormatError("metadata has no storage data", path=path)
        per_file: dict[str, list[MetadataIndex]] = {}
        for idx, info in sorted(md.storage_data.items(), key=lambda kv: (kv[1].relative_path, kv[1].offset)):
            per_file.setdefault(info.relative_path, []).append(idx)
        self.layout = list(per_file.items())
        self.files = len(self.layout)
        self._sizes = tensor_chunk_sizes(md)
        self.version = f"DCP metadata {md.version}"

    def _info(self, idx: MetadataIndex) -> Any:
        try:
            return self.metadata.storage_data[idx]
        except KeyError:
            raise FormatError("metadata has no storage record for this entry", path=self.path,
                              entry=label(idx)) from None

    def _check(self, t: torch.Tensor, idx: MetadataIndex, where: str) -> torch.Tensor:
        item = self.metadata.state_dict_metadata.get(idx.fqn)
        want = self._sizes.get((idx.fqn, tuple(idx.offset or ())))
        if not isinstance(item, TensorStorageMetadata) or want is None:
            raise FormatError("storage record names a tensor chunk the metadata does not list", path=where,
                              entry=label(idx))
        if t.dtype != item.properties.dtype or tuple(t.shape) != want:
            raise FormatError(f"stored chunk is {t.dtype} {list(t.shape)}, the metadata says "
                              f"{item.properties.dtype} {list(want)}", path=where, entry=label(idx))
        return t

    def bytes_length(self, idx: MetadataIndex) -> int:
        return self._info(idx).length


class _MmapckptSource(_DcpSource):
    def __init__(self, path: str, md: Metadata) -> None:
        super().__init__(path, KIND_MMAPCKPT, md)
        self._shards: dict[str, Shard] = {}
        if self.layout:
            first = self._shard(self.layout[0][0])
            self.version = f"shard format {fmt.FORMAT_MAJOR}.{first.header.minor}, {self.version}"

    def _shard(self, rel: str) -> Shard:
        if rel not in self._shards:
            shard = Shard(open_inside(self.path, rel))
            want = getattr(self.metadata.storage_meta, "save_id", None)
            if shard.header.save_id is not None and want is not None and shard.header.save_id != want:
                raise FormatError(f"shard was written by save {shard.header.save_id}, the metadata by save {want}",
                                  path=shard.path)
            self._shards[rel] = shard
        return self._shards[rel]

    def _entry(self, idx: MetadataIndex, chunk: tuple[int, ...] | None) -> tuple[Shard, fmt.Entry]:
        info = self._info(idx)
        shard = self._shard(info.relative_path)
        e = shard.entry(idx.fqn, chunk)
        if (info.offset, info.length) != (e.offset, e.length):
            raise FormatError(f"metadata says bytes [{info.offset}, +{info.length}) but the shard header says "
                              f"[{e.offset}, +{e.length})", path=shard.path, entry=e.label)
        # Checked on every read: a conversion must not carry damaged bytes into a format without checksums.
        shard.verify(e)
        return shard, e

    def read_tensor(self, idx: MetadataIndex) -> torch.Tensor:
        shard, e = self._entry(idx, tuple(idx.offset or ()))
        if e.kind != fmt.KIND_TENSOR:
            raise FormatError("metadata says tensor but the shard holds bytes", path=shard.path, entry=e.label)
        return self._check(shard.tensor(e), idx, shard.path)

    def read_bytes(self, idx: MetadataIndex) -> bytes:
        shard, e = self._entry(idx, None)
        return shard.read_bytes(e)

    def close(self) -> None:
        self._shards.clear()


class _FileSlice(io.RawIOBase):
    """A read-only, seekable window [offset, offset + length) of a file, for torch.load."""

    def __init__(self, fd: int, offset: int, length: int, path: str) -> None:
        self._fd, self._base, self._len, self._pos, self._path = fd, offset, length, 0, path

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._len}[whence]
        self._pos = max(0, base + pos)
        return self._pos

    def readinto(self, buf: Any) -> int:
        mv = memoryview(buf).cast("B")
        n = max(0, min(len(mv), self._len - self._pos))
        if n:
            pread_into(self._fd, mv[:n], self._base + self._pos, path=self._path)
        self._pos += n
        return n


class _StockSource(_DcpSource):
    """Stock DCP: every item is ``torch.save`` bytes at (file, offset, length); tensors load with weights_only."""

    def __init__(self, path: str, md: Metadata) -> None:
        super().__init__(path, "dcp", md)
        self.version += ", torch.save items"
        self._fds: dict[str, tuple[int, int, str]] = {}

    def _slice(self, idx: MetadataIndex) -> _FileSlice:
        info = self._info(idx)
        if getattr(info, "transform_descriptors", None):
            raise FormatError("stream transforms are not supported", path=self.path, entry=label(idx))
        if info.relative_path not in self._fds:
            full = open_inside(self.path, info.relative_path)
            try:
                fd = os.open(full, os.O_RDONLY)
            except FileNotFoundError:
                raise IncompleteCheckpointError("shard file named in the metadata is missing", path=full,
                                      entry=label(idx)) from None
            self._fds[info.relative_path] = (fd, os.fstat(fd).st_size, full)
        fd, size, full = self._fds[info.relative_path]
        if info.offset + info.length > size:
            raise TruncatedFileError(f"item [{info.offset}, +{info.length}) runs past the end of the "
                                     f"{size}-byte file", path=full, entry=label(idx))
        return _FileSlice(fd, info.offset, info.length, full)

    def read_tensor(self, idx: MetadataIndex) -> torch.Tensor:
        sl = self._slice(idx)
        return self._check(load_tensor(sl, path=sl._path, entry=label(idx)), idx, sl._path)

    def read_bytes(self, idx: MetadataIndex) -> bytes:
        sl = self._slice(idx)
        buf = bytearray(sl._len)
        sl.readinto(buf)
        return bytes(buf)

    def close(self) -> None:
        for fd, _, _ in self._fds.values():
            os.close(fd)
        self._fds.clear()


# --------------------------------------------------------------------------- detection
def _safetensors_index(path: str) -> dict[str, list[str]]:
    idx_path = _index_file(path)
    if idx_path is None:
        raise CheckpointNotFoundError("no *.safetensors.index.json here", path=path)
    try:
        with open(idx_path, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:
        raise FormatError(f"unreadable safetensors index: {e}", path=idx_path) from None
    wm = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(wm, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in wm.items()):
        raise FormatError("safetensors index has no 'weight_map' of name -> file", path=idx_path)
    files: dict[str, list[str]] = {}
    for name, rel in wm.items():
        full = open_inside(path, rel)
        if not os.path.isfile(full):
            raise CheckpointError("shard file named in the index is missing", path=full, entry=name)
        files.setdefault(full, []).append(name)
    return files


def _index_file(path: str) -> str | None:
    """The directory's safetensors index: model.safetensors.index.json, else the only *.safetensors.index.json."""
    if os.path.isfile(os.path.join(path, SAFETENSORS_INDEX)):
        return os.path.join(path, SAFETENSORS_INDEX)
    found = sorted(n for n in os.listdir(path) if n.endswith(".safetensors.index.json"))
    return os.path.join(path, found[0]) if len(found) == 1 else None


def _looks_like_safetensors(path: str) -> bool:
    with open(path, "rb") as f:
        head = f.read(9)
    if len(head) < 9:
        return False
    n = int.from_bytes(head[:8], "little")
    return head[8:9] == b"{" and 2 <= n <= os.path.getsize(path) - 8


def detect_format(path: str | os.PathLike[str]) -> str:
    """The format of the checkpoint at ``path``: one of FORMATS.

    Raises:
        CheckpointNotFoundError: nothing there, or nothing recognisable.
        IncompleteCheckpointError: DCP shards without committed metadata.
    """
    p = os.fspath(path)
    if os.path.isdir(p):
        if os.path.isfile(os.path.join(p, METADATA_NAME)):
            with open(os.path.join(p, METADATA_NAME), "rb") as f:
                head = f.read(8)
            from .metafile import metadata_kind
            kind = metadata_kind(head)
            if kind is None:
                raise FormatError("neither mmapckpt nor stock DCP metadata", path=os.path.join(p, METADATA_NAME))
            return kind
        if _index_file(p) is not None:
            return "safetensors"
        find_metadata(p)  # raises IncompleteCheckpointError or CheckpointNotFoundError
    if not os.path.exists(p):
        raise CheckpointNotFoundError("no such file or directory", path=p)
    if not os.path.isfile(p):
        raise CheckpointNotFoundError("not a checkpoint file or directory", path=p)
    if p.endswith(".safetensors") or _looks_like_safetensors(p):
        return "safetensors"
    with open(p, "rb") as f:
        head = f.read(2)
    if zipfile.is_zipfile(p) or head[:1] == b"\x80":
        return "torch"
    raise CheckpointNotFoundError("not a recognised checkpoint (mmapckpt, DCP, safetensors or torch.save)", path=p)


def open_source(path: str | os.PathLike[str]) -> Source:
    """Open the checkpoint at ``path`` (any format of FORMATS) for reading."""
    p = os.fspath(path)
    if os.path.basename(p) == METADATA_NAME and os.path.isfile(p):
        p = os.path.dirname(p) or "."
    kind = detect_format(p)
    if kind in ("mmapckpt", "dcp"):
        got, md = read_metadata_file(find_metadata(p))
        return _MmapckptSource(p, md) if got == KIND_MMAPCKPT else _StockSource(p, md)
    from ._convert_flat import SafetensorsSource, TorchSource

    if kind == "safetensors":
        return SafetensorsSource(p, _safetensors_index(p) if os.path.isdir(p) else {p: []})
    return TorchSource(p)
