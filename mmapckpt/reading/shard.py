"""One shard file read through the storage (storage/base.py ``StoredFile``): validated header, tensors as views.

The preamble and the header's checksum and top level are checked before anything is
mapped. Where the medium maps files (local ones) a chunk is a view over the mapping;
where it cannot, the chunk is read into a new tensor (:meth:`Shard.view`). Every entry of
the header is checked against the file's size when the header is first used (at once,
unless ``check_entries=False``); readers that take each entry's place from the checkpoint
metadata instead use :meth:`Shard.view`, which checks the one region it is given. Either way a view never reaches past the end of
the file as it was when opened (a file truncated later can still raise SIGBUS: see
docs/reliability.md).
"""

from __future__ import annotations

from functools import cached_property
from typing import TYPE_CHECKING, Any

from ..errors import (
    UnsafePathError,
    CheckpointError,
    ChecksumError,
    EntryBoundsError,
    FormatError,
    IncompleteCheckpointError,
    SizeMismatchError,
    TruncatedFileError,
)
from ..format.crc import crc32
from ..format import layout as fmt
from ..format.entries import ROOT_MARKER, SaveId, reference_parts
from ..io.mapped import MappedFile
from ..storage.base import CheckpointStorage, StoredFile
from ..storage.local import LocalFile

if TYPE_CHECKING:  # torch is imported where a tensor is made: opening a shard, checking its header and its
    import torch   # checksums need none (inspect and verify of an mmapckpt checkpoint import no torch)
    from ..format.transforms import StreamTransforms  # a caller that decodes entries brings its own

__all__ = ["Shard", "is_mmapckpt_shard", "encoded_bytes", "decode_entry", "open_named", "shard_of", "check_reach",
           "file_save_id"]


def is_mmapckpt_shard(file: StoredFile) -> bool:
    """Whether the file starts with an mmapckpt shard's magic (else: a stock DCP shard)."""
    return file.size >= len(fmt.MAGIC) and bytes(file.read(0, len(fmt.MAGIC))) == fmt.MAGIC


# --------------------------------------------------------------------------- the one way to open a DCP data file
# Every reader of a DCP directory (ChunkFiles for open/load/convert/inspect, dcp/read_paths.FileReads for
# MmapReader, tools/verify.py) opens its data files with these, so that the same damage is the same error.
def open_named(storage: CheckpointStorage, rel: str, save_id: str | None, entry: str | None = None) -> StoredFile:
    """Data file ``rel``, which the metadata of save ``save_id`` names, opened through ``storage``. A cross-step
    reference ``../step-M/FILE`` (docs/format.md 3.4) is opened in the sibling step, only inside a managed root.

    Raises:
        IncompleteCheckpointError: the location lacks it (saying so where the checkpoint was replaced meanwhile).
        UnsafePathError: a reference outside a managed root, to the step itself, or through a link.
    """
    if rel.startswith("../"):
        storage, rel = _referenced(storage, rel, entry)
        save_id = None
    try:
        return storage.open_file(rel)
    except IncompleteCheckpointError:
        from ..storage.commits import missing_shard_error  # the explanation of a missing file only

        raise missing_shard_error(storage, storage.full(rel), save_id, entry) from None


def _referenced(storage: CheckpointStorage, rel: str, entry: str | None) -> tuple[CheckpointStorage, str]:
    """(the sibling step's storage, the file's name there) of a cross-step reference, checked: a name of the
    reference form, a step other than this one, a parent that holds the root marker."""
    parts = reference_parts(rel)
    if parts is None:
        raise UnsafePathError(f"storage path {rel!r} leaves the checkpoint directory", path=storage.location,
                              entry=entry)
    step, name = parts
    if step == storage.location.replace("\\", "/").rstrip("/").rsplit("/", 1)[-1]:
        raise UnsafePathError(f"cross-step reference {rel!r} names this step itself", path=storage.location,
                              entry=entry)
    if not storage.sibling("").exists(ROOT_MARKER):
        raise UnsafePathError(f"cross-step reference {rel!r}, but the parent of this checkpoint is no managed root "
                              f"(it has no {ROOT_MARKER}): a checkpoint outside a root refers to nothing outside "
                              "itself; copy the root whole", path=storage.location, entry=entry)
    return storage.sibling(step), name


def file_save_id(save_id: str | None, rel: str) -> str | None:
    """The save id data file ``rel`` must carry: a referenced file's own (the metadata's ``references``), else
    the metadata's."""
    return save_id.of(rel) if isinstance(save_id, SaveId) else save_id


def shard_of(f: StoredFile, save_id: str | None, *, stock: bool = True, records: list[tuple[Any, ...]] | None = None,
             check_entries: bool = False, referenced: bool = False) -> "Shard | None":
    """The mmapckpt shard ``f`` holds, written by save ``save_id``; None for a stock DCP file (``stock``: the
    metadata is a stock one, whose files may be either). ``records``: the file's entries as the metadata places
    them (see :meth:`Shard.agrees`), which spares decoding the header where it agrees. ``f`` is not closed here.
    ``referenced``: a sibling step's shard (a cross-step reference), which must carry ``save_id`` exactly.

    Raises:
        IncompleteCheckpointError: a shard of another save (replaced meanwhile, or copied in from another).
        FormatError: no valid shard (also a stock file where the metadata is mmapckpt's).
    """
    if stock and not referenced and not is_mmapckpt_shard(f):
        return None
    shard = Shard(f, check_entries=check_entries)
    if records is not None and shard.agrees(save_id, records):  # the usual case: no entry of the header decoded
        return shard
    sid = shard.save_id
    if referenced and sid != save_id:
        raise IncompleteCheckpointError(
            f"referenced shard was written by save {sid}, but the metadata refers to save {save_id}'s: the step "
            "it belongs to was replaced, or the file was copied in from elsewhere; this step cannot be loaded",
            path=shard.path)
    if None not in (sid, save_id) and sid != save_id:
        raise IncompleteCheckpointError(
            f"shard was written by save {sid}, but the metadata belongs to save {save_id}: the checkpoint was "
            "replaced while it was being loaded (load it again), or the file was copied in from another save",
            path=shard.path)
    return shard


def check_reach(f: StoredFile, end: int, entry: str) -> None:
    """Refuse a file that ends before byte ``end``, where the metadata's last record of it (``entry``) ends."""
    if end > f.size:
        raise TruncatedFileError(f"data runs past the end of the {f.size}-byte file: its records reach byte {end}",
                                 path=f.path, entry=entry)


class Shard:
    """A validated mmapckpt shard file, mapped where its medium maps.

    Attributes:
        stored: the file as its storage opened it (``storage/base.py`` ``StoredFile``).
        file: its mapping, or None where the medium has none.
        path: the file's path.
        header: its decoded header, every entry checked (decoded on first use).
        save_id: the id of the save that wrote it, if recorded.
        data_start: the first byte after the header.
        size: its size when opened.
        ident: what identifies the file opened (``(st_dev, st_ino)`` locally).
    """

    def __init__(self, file: StoredFile | str, *, check_entries: bool = True) -> None:
        #: the file, open through its storage (a local path is opened as a LocalFile)
        self.stored = file if isinstance(file, StoredFile) else LocalFile(file)
        self.path = path = self.stored.path
        size = self.stored.size
        try:
            pre = self.stored.read(0, min(fmt.PREAMBLE_SIZE, size))
            minor, order, hlen, hcrc = fmt.decode_preamble(bytes(pre), size, path)
            body = self.stored.read(fmt.PREAMBLE_SIZE, hlen)
        except BaseException:
            if not isinstance(file, StoredFile):
                self.stored.close()
            raise
        self._body, self._hcrc = bytes(body), hcrc
        self._order, self._minor = order, minor
        self._agreed: str | None = None  # the save id, once the header is known to be the metadata's (agrees())
        self.data_start = fmt.PREAMBLE_SIZE + hlen
        self.size = size
        if check_entries:
            self.header  # decode and check every entry now
        # The mapping is of the file the header was read from, never of the path again: a file
        # renamed over the path in between would pair this header with other bytes.
        #: the file mapped (views without copying), or None where its medium cannot map
        self.file: MappedFile | None = self.stored.mapping

    @property
    def source(self) -> MappedFile | StoredFile:
        """What a ``Moves`` of this file's chunks reads from: the mapping, or the file where it has none."""
        return self.file if self.file is not None else self.stored

    def close(self) -> None:
        """Release the file (views already built keep their mapping)."""
        self.stored.close()

    @property
    def ident(self) -> object:
        return self.stored.ident

    @cached_property
    def _decoded(self) -> tuple[dict[str, Any], str | None]:
        return fmt.decode_header_doc(self._body, header_crc=self._hcrc, path=self.path)

    @property
    def _doc(self) -> dict[str, Any]:
        return self._decoded[0]

    @property
    def save_id(self) -> str | None:
        """The id of the save that wrote the shard, if its header records one."""
        return self._agreed if self._agreed is not None else self._decoded[1]

    def agrees(self, save_id: str | None, records: list[tuple[Any, ...]]) -> bool:
        """Whether the header is exactly what the writer wrote for ``records`` (every entry of this file, as
        the metadata of save ``save_id`` places them: fqn, chunk offsets, kind, dtype name, shape, offset,
        length) and its checksum holds. Then :meth:`view` of those chunks checks only their bounds."""
        if save_id is None or crc32(self._body) != self._hcrc or not fmt.header_agrees(
                self._body, save_id, records):
            return False
        self._agreed = save_id
        return True

    def hashes(self, *, unhashed: bool = False,
               ) -> dict[tuple[str, tuple[int, ...]], tuple[str | None, int, int | None]]:
        """``{(fqn, chunk offsets): (content hash, offset, CRC-32 of its head)}`` of the tensor entries whose header
        records a content hash (docs/format.md 2.7; what a save with ``reuse=`` compares its chunks with); with
        ``unhashed``, the others too, as ``(None, offset, None)``."""
        return fmt.entry_hashes(self._doc, unhashed=unhashed)

    @cached_property
    def header(self) -> fmt.ShardHeader:
        return fmt.decode_header(self._body, header_crc=0, byte_order=self._order, minor=self._minor,
                                 file_size=self.size, path=self.path, doc=self._doc)

    @cached_property
    def _entries(self) -> dict[tuple[str, tuple[int, ...] | None], fmt.Entry]:
        return self.header.by_key()

    @cached_property
    def _placed(self) -> dict[tuple[str, tuple[int, ...] | None], tuple[Any, ...]]:
        """(offset, length, dtype, shape) of every entry by key, from the header without checking each entry."""
        try:
            return {(e["fqn"], tuple(e["chunk_offsets"])) if "chunk_offsets" in e else (e["fqn"], None):
                    (e["offset"], e["length"], e.get("dtype"), e.get("shape"))
                    + ((tuple(e["transforms"]),) if e.get("kind") == fmt.KIND_ENCODED else ())
                    for e in self._doc["entries"]}
        except (KeyError, TypeError, AttributeError):  # malformed: the full decode says what is wrong
            self.header
            raise FormatError("header entries are malformed", path=self.path) from None

    def view(self, key: tuple[str, tuple[int, ...]], offset: int, length: int, dtype: torch.dtype,
             shape: tuple[int, ...], *, lazy: bool = False) -> torch.Tensor:
        """The chunk ``key`` (fqn, chunk offsets), placed by the metadata at ``length`` bytes from ``offset``,
        as a contiguous tensor of ``dtype`` and ``shape`` over the mapping (no copy). A file without a
        mapping is read into a new tensor; with ``lazy``, a placeholder stands for it instead, for a
        ``Moves`` of :attr:`source` to read (reading/fetches.py).

        The shard header must describe the chunk in the same way (checked per chunk, without
        decoding every entry of the header), and the bytes must lie after the header, inside
        the file, aligned, and be as long as the shape says.
        """
        self._check_placed(key, offset, length, dtype, shape)
        if self.file is not None:
            return self.file.view(offset, dtype, shape)
        if lazy:
            from .fetches import placeholder

            return placeholder(offset, dtype, shape)
        import torch

        out = torch.empty(shape, dtype=dtype)
        if length:
            self.stored.read_into(offset, out.reshape(-1).view(torch.uint8).numpy(), entry=_label(key))
        return out

    def region(self, key: tuple[str, tuple[int, ...]], offset: int, length: int, dtype: torch.dtype,
               shape: tuple[int, ...], index: tuple[slice, ...]) -> torch.Tensor:
        """``view(...)[index]``, checked as :meth:`view`; without a mapping only the bytes ``index`` needs are
        read (reading/regions.py ``read_region``)."""
        if self.file is not None:
            return self.view(key, offset, length, dtype, shape)[index]
        self._check_placed(key, offset, length, dtype, shape)
        from .regions import read_region

        return read_region(self.stored, offset, dtype, shape, index, entry=_label(key))

    def _check_placed(self, key: tuple[str, tuple[int, ...]], offset: int, length: int, dtype: torch.dtype,
                      shape: tuple[int, ...]) -> None:
        if self._agreed is None:
            want = (offset, length, fmt.dtype_name(dtype), list(shape))
            if self._placed.get(key) != want:
                _refuse_placed(self, key, want)
        if not self._in_bounds(offset, length):
            _refuse_region(self, key, offset, length)

    def object_bytes(self, fqn: str, offset: int, length: int) -> bytes:
        """The bytes of the non-tensor entry ``fqn``, placed by the metadata (checked as in :meth:`view`)."""
        want = (offset, length, None, None)
        if self._agreed is None and self._placed.get((fqn, None)) != want:
            _refuse_placed(self, (fqn, None), want)
        if not self._in_bounds(offset, length):
            _refuse_region(self, (fqn, None), offset, length)
        return bytes(self._bytes(offset, length, fqn))

    def _bytes(self, offset: int, length: int, label: str) -> Any:
        """``length`` bytes at ``offset``: a view of the mapping, or read."""
        if self.file is not None:
            return self.file.memory(offset, length)
        return self.stored.read(offset, length, entry=label)

    def _in_bounds(self, offset: int, length: int) -> bool:
        return self.data_start <= offset and offset + length <= self.size and not offset % fmt.MIN_ALIGNMENT

    def entry(self, fqn: str, chunk_offsets: tuple[int, ...] | None) -> fmt.Entry:
        try:
            return self._entries[(fqn, chunk_offsets)]
        except KeyError:
            label = fqn if chunk_offsets is None else f"{fqn}@{list(chunk_offsets)}"
            raise CheckpointError("entry is not in this shard's header", path=self.path, entry=label) from None

    def raw(self, e: fmt.Entry) -> torch.Tensor:
        """The entry's bytes as a uint8 tensor: a view over the mapping (no copy), or read."""
        if self.file is not None:
            return self.file.raw(e.offset, e.length)
        import torch

        data = self.stored.read(e.offset, e.length, entry=e.label)
        return torch.frombuffer(data, dtype=torch.uint8) if e.length else torch.empty(0, dtype=torch.uint8)

    def tensor(self, e: fmt.Entry) -> torch.Tensor:
        """The entry as a tensor of its dtype and shape, a copy-on-write view over the mapping."""
        import torch

        dtype = fmt.DTYPES[e.dtype][0]  # type: ignore[index]
        if e.length == 0:
            return torch.empty(e.shape, dtype=dtype)
        return self.raw(e).view(dtype).view(e.shape)

    def read_bytes(self, e: fmt.Entry) -> bytes:
        return bytes(self._bytes(e.offset, e.length, e.label))

    def verify(self, e: fmt.Entry) -> None:
        """Raise ChecksumError if the entry's bytes do not match their CRC-32."""
        got = crc32(self._bytes(e.offset, e.length, e.label)) if e.length else 0
        if got != e.crc32:
            raise ChecksumError(f"CRC-32 of the data is {got:08x}, the header says {e.crc32:08x}",
                                path=self.path, entry=e.label)


def encoded_bytes(shard: Shard, key: tuple[str, tuple[int, ...] | None], offset: int,
                  length: int) -> tuple[memoryview, tuple[str, ...]]:
    """The stored bytes of the KIND_ENCODED entry ``key`` of ``shard`` (placed by the metadata, checked
    as in :meth:`Shard.view`) as a view over the mapping, and its transform descriptors."""
    got = shard._placed.get(key)
    if got is None or len(got) != 5 or got[:2] != (offset, length):
        e = shard.entry(*key)
        raise FormatError(f"metadata says bytes [{offset}, +{length}) stored through stream transforms, but the "
                          f"shard header has a {e.kind} entry at [{e.offset}, +{e.length})", path=shard.path,
                          entry=_label(key))
    if not shard._in_bounds(offset, length):
        _refuse_region(shard, key, offset, length)
    return memoryview(shard._bytes(offset, length, _label(key))), got[4]


def decode_entry(shard: Shard, e: fmt.Entry, transforms: StreamTransforms) -> torch.Tensor | bytes:
    """A KIND_ENCODED entry's value, decoded into memory: a new tensor (a chunk) or bytes (a payload)."""
    import torch

    stored = memoryview(shard._bytes(e.offset, e.length, e.label))
    if e.chunk_offsets is None:
        return transforms.decode(stored, e.transforms, path=shard.path, entry=e.label)  # type: ignore[return-value]
    out = torch.empty(e.shape, dtype=fmt.DTYPES[e.dtype][0])  # type: ignore[index]
    into = memoryview(out.reshape(-1).view(torch.uint8).numpy()) if out.numel() else memoryview(bytearray())
    transforms.decode(stored, e.transforms, path=shard.path, entry=e.label, into=into)
    return out


def _refuse_placed(shard: Shard, key: tuple[str, tuple[int, ...] | None], want: tuple[Any, ...]) -> None:
    """Raise for a header that does not describe ``key`` as the metadata does (``want``)."""
    got = shard._placed.get(key)
    shard.header  # a header that is itself invalid raises its own, more precise error
    label = _label(key)
    if got is None:
        raise FormatError("entry is not in this shard's header", path=shard.path, entry=label)
    if len(got) == 5:  # KIND_ENCODED: its stored bytes are not the value's
        raise FormatError(f"entry is stored through stream transforms {list(got[4])}, which only dcp.load with "
                          "MmapReader(path, _extension_registry=...) undoes; this reader takes raw entries "
                          "only", path=shard.path, entry=label)
    if got[:3] == want[:3]:
        raise SizeMismatchError(f"stored chunk is {got[3]}, the metadata says {want[3]}", path=shard.path,
                                entry=label)
    if got[:2] == want[:2]:
        raise FormatError(f"shard holds {got[2]} but the metadata says {want[2]}", path=shard.path, entry=label)
    raise FormatError(f"metadata says bytes [{want[0]}, +{want[1]}) but the shard header says "
                      f"[{got[0]}, +{got[1]})", path=shard.path, entry=label)


def _refuse_region(shard: Shard, key: tuple[str, Any], offset: int, length: int) -> None:
    if offset + length > shard.size:
        raise TruncatedFileError(f"data [{offset}, {offset + length}) runs past the end of the "
                                 f"{shard.size}-byte file", path=shard.path, entry=_label(key))
    raise EntryBoundsError(f"data [{offset}, +{length}) is not an aligned region after the header",
                           path=shard.path, entry=_label(key))


def _label(key: tuple[str, tuple[int, ...] | None]) -> str:
    """An entry's name in errors: ``fqn``, or ``fqn@[chunk offsets]`` for a tensor chunk (as Entry.label)."""
    return key[0] if key[1] is None else f"{key[0]}@{list(key[1])}"


def check_size_unchanged(shard: Shard) -> None:
    """Raise TruncatedFileError if the shard's file shrank since it was mapped."""
    shard.stored.check_unchanged()
