"""How to get a checkpoint's chunks.

``ChunkFiles`` opens the shard files through the checkpoint's storage (mmapckpt shards
validated and mapped, stock files read per item with ``torch.load(weights_only=True)``, or where a
stock shard holds its tensors as safetensors data, mapped: reading/dcp_safetensors.py) and
returns each chunk as a CPU tensor, a view over the mapping where it can. The index of entries
and chunks it works from is the metadata's (``storage/commits.py`` ``read_index``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable, Mapping

from ..errors import CheckpointError, SizeMismatchError
from ..format.dtypes import ITEMSIZES
from ..format.entries import ChunkInfo, EntryInfo
from ..io.mapped import MappedFile
from ..storage.base import CheckpointStorage, StoredFile
from .shard import Shard, check_reach, check_size_unchanged, file_save_id, open_named, shard_of

if TYPE_CHECKING:  # stock items' readers are imported by the first stock item read: a load of an mmapckpt
    import torch  # checkpoint imports neither

    from .dcp_safetensors import SafetensorsChunks

__all__ = ["ChunkInfo", "EntryInfo", "ChunkFiles", "records_by_file"]


def records_by_file(entries: Mapping[str, EntryInfo]) -> dict[str, list[tuple[Any, ...]]]:
    """Per file, its entries as the metadata places them, in its order (what ``Shard.agrees`` compares)."""
    out: dict[str, list[tuple[Any, ...]]] = {}
    for e in entries.values():
        tensor = e.kind == "tensor"
        dt = e.dtype_name if e.dtype_name in ITEMSIZES else None  # a stock dtype no shard can hold: none agrees
        for c in e.chunks:
            rec = (e.name, c.offsets, "tensor", dt, c.sizes, c.file_offset, c.length) if tensor else (
                e.name, None, "bytes", None, (), c.file_offset, c.length)
            try:
                out[c.file].append(rec)
            except KeyError:
                out[c.file] = [rec]
    return out


class ChunkFiles:
    """The chunk backend of ``mmapckpt.open`` for DCP directories: mmapckpt shards mapped, stock files read per item.

    A ``ChunkBackend`` (reading/backend.py).
    """

    #: non-tensor entries are pickles (``object_bytes``): unpickling them needs the caller's consent
    pickled_objects = True

    def __init__(self, storage: CheckpointStorage, entries: Mapping[str, EntryInfo], save_id: str | None, *,
                 verify: bool = False, stock: bool = True) -> None:
        """``stock``: the metadata is a stock DCP one (its files may be mmapckpt shards or stock files)."""
        self.storage = storage
        self.root = storage.location
        #: check each mmapckpt chunk's CRC-32 the first time it is read (stock items have none)
        self.verify = verify
        self._verified: set[tuple[str, tuple[int, ...] | None]] = set()
        self.shards: dict[str, Shard] = {}
        self.stock: dict[str, StoredFile] = {}
        #: (stock file, offset) -> its safetensors data there, or None for torch.save items
        self._safetensors: dict[tuple[str, int], SafetensorsChunks | None] = {}
        files = records_by_file(entries)
        try:
            for rel in sorted(files):
                self._open(rel, files[rel], save_id, stock)
        except BaseException:
            self.close()
            raise

    def _open(self, rel: str, records: list[tuple[Any, ...]], save_id: str | None, stock: bool) -> None:
        """Open data file ``rel`` the one way every reader does (reading/shard.py): present, of this save, and
        reaching the end of its last record (a cut file is refused at open, before any view of it)."""
        f = open_named(self.storage, rel, save_id)
        try:
            last = max(records, key=lambda r: r[5] + r[6])
            check_reach(f, last[5] + last[6], last[0] if last[1] is None else f"{last[0]}@{list(last[1])}")
            ref = rel.startswith("../")  # a sibling step's shard (cross-step reference): of its own save
            shard = shard_of(f, file_save_id(save_id, rel), stock=stock and not ref, records=records, referenced=ref)
        except BaseException:
            f.close()
            raise
        if shard is None:
            self.stock[rel] = f
        else:
            self.shards[rel] = shard

    def chunk(self, info: EntryInfo, c: ChunkInfo, *, lazy: bool = False) -> torch.Tensor:
        """The chunk as a CPU tensor: a view over the mapping (or read, or a placeholder: ``lazy``), or a stock
        item loaded whole."""
        shard = self.shards.get(c.file)
        if shard is not None:
            view = shard.view((info.name, c.offsets), c.file_offset, c.length, info.dtype,  # type: ignore[arg-type]
                              c.sizes, lazy=lazy)
            if self.verify:
                self._verify(shard, info.name, c.offsets)
            return view
        label = f"{info.name}@{list(c.offsets)}"
        st = self._stock_safetensors(info, c)
        if st is not None:
            offset, length = st.locate(info.name, c.offsets, info.dtype, c.sizes, label)  # type: ignore[arg-type]
            return st.view(offset, length, info.dtype, c.sizes, lazy=lazy)  # type: ignore[arg-type]
        from ..format.stock import load_tensor

        t = load_tensor(self._read_stock(c, label), path=self.stock[c.file].path, entry=label).contiguous()
        if t.dtype != info.dtype or tuple(t.shape) != c.sizes:
            raise SizeMismatchError(f"stored chunk is {t.dtype} {list(t.shape)}, the metadata says {info.dtype} "
                                    f"{list(c.sizes)}", path=self.storage.full(c.file), entry=label)
        return t

    def region(self, info: EntryInfo, c: ChunkInfo, index: tuple[slice, ...]) -> torch.Tensor:
        """``chunk(info, c)[index]``; from an mmapckpt shard without a mapping and without ``verify`` (which
        needs every byte), only the bytes ``index`` needs are read."""
        shard = self.shards.get(c.file)
        if shard is None or shard.file is not None or self.verify:
            return self.chunk(info, c)[index]
        return shard.region((info.name, c.offsets), c.file_offset, c.length, info.dtype,  # type: ignore[arg-type]
                            c.sizes, index)

    def mapped(self, info: EntryInfo, c: ChunkInfo) -> MappedFile | StoredFile | None:
        """The mapping ``chunk`` returns a view of (for direct reads), the file where it has no mapping, or
        None (a stock item, loaded whole)."""
        shard = self.shards.get(c.file)
        if shard is not None:
            return shard.source
        st = self._stock_safetensors(info, c)
        if st is None:
            return None
        offset, _ = st.locate(info.name, c.offsets, info.dtype, c.sizes, info.name)  # type: ignore[arg-type]
        return st.source if st.aligned(offset, info.dtype) else None  # type: ignore[arg-type]

    def _stock_safetensors(self, info: EntryInfo, c: ChunkInfo) -> SafetensorsChunks | None:
        """The safetensors data a stock shard holds its tensors in, where chunk ``c`` is recorded (else None:
        a torch.save item, whose bytes are not probed: reading/dcp_safetensors.py ``raw_record``)."""
        from .dcp_safetensors import raw_record, stock_safetensors

        if not raw_record(c.length, info.dtype, c.sizes):  # type: ignore[arg-type]
            return None  # a torch.save item: not probed, not cached (the records of one data start share a key)
        key = (c.file, c.file_offset)
        if key not in self._safetensors:
            self._safetensors[key] = stock_safetensors(self.stock[c.file], c.file_offset, c.length,
                                                       info.dtype, c.sizes)  # type: ignore[arg-type]
        return self._safetensors[key]

    def object_bytes(self, info: EntryInfo) -> bytes:
        c = info.chunks[0]
        shard = self.shards.get(c.file)
        if shard is None:
            return self._read_stock(c, info.name)
        data = shard.object_bytes(info.name, c.file_offset, c.length)
        if self.verify:
            self._verify(shard, info.name, None)
        return data

    def _verify(self, shard: Shard, name: str, offsets: tuple[int, ...] | None) -> None:
        key = (name, offsets)
        if key not in self._verified:
            shard.verify(shard.entry(name, offsets))  # the header's entry agrees with the metadata (view checked it)
            self._verified.add(key)

    def _read_stock(self, c: ChunkInfo, label: str) -> bytes:
        return bytes(self.stock[c.file].read(c.file_offset, c.length, entry=label))

    def advise(self, c: ChunkInfo, advice: int, *, sequential: bool = False) -> None:
        """Pass a madvise hint for the chunk's pages (no-op for stock files)."""
        shard = self.shards.get(c.file)
        if shard is not None and shard.file is not None:
            shard.file.advise(advice, c.file_offset, c.length, sequential=sequential)

    def check_unchanged(self, chunks: Iterable[ChunkInfo]) -> None:
        """Raise TruncatedFileError if a mapped file holding one of ``chunks`` shrank since it was opened."""
        for rel in {c.file for c in chunks}:
            shard = self.shards.get(rel)
            if shard is not None:
                check_size_unchanged(shard)
            elif rel in self.stock:
                self.stock[rel].check_unchanged()

    def object_value(self, info: EntryInfo) -> Any:
        raise CheckpointError("entry is a pickled non-tensor value: its bytes are object_bytes()", path=self.root,
                              entry=info.name)

    def close(self) -> None:
        """Release every file (views already returned keep their mappings)."""
        for shard in self.shards.values():
            shard.close()
        for f in self.stock.values():
            f.close()
