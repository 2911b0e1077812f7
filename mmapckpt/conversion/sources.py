"""Conversion sources for DCP checkpoint directories: mmapckpt shards and stock ``torch.save`` items, read through
the checkpoint's storage (storage/base.py)."""

from __future__ import annotations

import io
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata

from ..errors import FormatError, IncompleteCheckpointError
from ..format import layout as fmt
from ..format.metadata import KIND_MMAPCKPT
from ..format.stock import load_tensor
from ..format.transforms import StreamTransforms
from ..reading.dcp_safetensors import SafetensorsChunks, raw_record
from ..reading.safetensors_files import is_safetensors_file
from ..reading.shard import Shard, decode_entry
from ..reading.torchfile import StoredReader
from ..storage.base import CheckpointStorage, StoredFile
from ..storage.commits import read_user_metadata
from ..storage.location import storage_for
from .common import Source, label, tensor_chunk_sizes

__all__ = ["MmapckptSource", "StockSource"]


class _DcpSource(Source):
    def __init__(self, path: str, kind: str, md: Metadata, storage: CheckpointStorage | None = None) -> None:
        self.path, self.kind, self.metadata = path, kind, md
        self.storage = storage_for(path) if storage is None else storage
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


class MmapckptSource(_DcpSource):
    def __init__(self, path: str, md: Metadata, storage: CheckpointStorage | None = None) -> None:
        super().__init__(path, KIND_MMAPCKPT, md, storage)
        self._shards: dict[str, Shard] = {}
        self._transforms = StreamTransforms()  # DCP's registry: undoes ZStandard
        if self.layout:
            first = self._shard(self.layout[0][0])
            self.version = f"shard format {fmt.FORMAT_MAJOR}.{first.header.minor}, {self.version}"

    def _shard(self, rel: str) -> Shard:
        if rel not in self._shards:
            shard = Shard(self.storage.open_file(rel))
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
        if e.kind == fmt.KIND_ENCODED and e.chunk_offsets is not None:  # MmapWriter(_extensions=...)
            return self._check(decode_entry(shard, e, self._transforms), idx, shard.path)  # type: ignore[arg-type]
        if e.kind != fmt.KIND_TENSOR:
            raise FormatError("metadata says tensor but the shard holds bytes", path=shard.path, entry=e.label)
        return self._check(shard.tensor(e), idx, shard.path)

    def read_bytes(self, idx: MetadataIndex) -> bytes:
        shard, e = self._entry(idx, None)
        if e.kind == fmt.KIND_ENCODED:
            return decode_entry(shard, e, self._transforms)  # type: ignore[return-value]
        return shard.read_bytes(e)

    def user_metadata(self) -> dict[str, str] | None:
        return read_user_metadata(self.storage)

    def close(self) -> None:
        shards, self._shards = self._shards, {}
        for shard in shards.values():
            shard.close()


class StockSource(_DcpSource):
    """Stock DCP: every item is ``torch.save`` bytes at (file, offset, length); tensors load with weights_only."""

    def __init__(self, path: str, md: Metadata, storage: CheckpointStorage | None = None) -> None:
        super().__init__(path, "dcp", md, storage)
        self.version += ", torch.save items"
        self._transforms = StreamTransforms()  # DCP's registry: undoes ZStandard
        self._files: dict[str, StoredFile] = {}
        self._st: dict[tuple[str, int], SafetensorsChunks | None] = {}

    def _slice(self, idx: MetadataIndex) -> StoredReader:
        info = self._info(idx)
        f = self._files.get(info.relative_path)
        if f is None:
            try:
                f = self._files[info.relative_path] = self.storage.open_file(info.relative_path)
            except IncompleteCheckpointError as e:
                raise IncompleteCheckpointError("shard file named in the metadata is missing", path=e.path,
                                                entry=label(idx)) from None
        if info.offset + info.length > f.size:
            f.read(info.offset, info.length, entry=label(idx))  # raises TruncatedFileError naming the item
        return StoredReader(f, info.offset, info.length)

    def _decoded(self, idx: MetadataIndex, sl: StoredReader) -> bytes | None:
        """The item's bytes with its stream transforms undone (FileSystemWriter(_extensions=...)), else None."""
        descriptors = getattr(self._info(idx), "transform_descriptors", None)
        if not descriptors:
            return None
        buf = bytearray(sl.length)
        sl.readinto(buf)
        return self._transforms.decode(memoryview(buf), descriptors, path=sl.file.path, entry=label(idx))

    def read_tensor(self, idx: MetadataIndex) -> torch.Tensor:
        sl = self._slice(idx)
        item = self.metadata.state_dict_metadata.get(idx.fqn)
        want = self._sizes.get((idx.fqn, tuple(idx.offset or ())))
        st = None
        if isinstance(item, TensorStorageMetadata) and want is not None and raw_record(
                sl.length, item.properties.dtype, tuple(want)):
            st = self._safetensors(sl)
        if st is not None:  # a SAFETENSORS-format shard: the chunk is found by name (reading/dcp_safetensors.py)
            dtype = item.properties.dtype  # type: ignore[union-attr]
            offset, length = st.locate(idx.fqn, tuple(idx.offset or ()), dtype, tuple(want), label(idx))  # type: ignore[arg-type]
            return st.view(offset, length, dtype, tuple(want))  # type: ignore[arg-type]
        data = self._decoded(idx, sl)
        src: Any = sl if data is None else io.BytesIO(data)
        return self._check(load_tensor(src, path=sl.file.path, entry=label(idx)), idx, sl.file.path)

    def _safetensors(self, sl: StoredReader) -> SafetensorsChunks | None:
        """The safetensors data at the record's offset (a SAFETENSORS-format shard), or None (torch.save items)."""
        key = (sl.file.path, sl.base)
        if key not in self._st:
            self._st[key] = SafetensorsChunks(sl.file, sl.base) if is_safetensors_file(sl.file, sl.base) else None
        return self._st[key]

    def read_bytes(self, idx: MetadataIndex) -> bytes:
        sl = self._slice(idx)
        data = self._decoded(idx, sl)
        if data is not None:
            return data
        buf = bytearray(sl.length)
        sl.readinto(buf)
        return bytes(buf)

    def close(self) -> None:
        files, self._files = self._files, {}
        for f in files.values():
            f.close()
