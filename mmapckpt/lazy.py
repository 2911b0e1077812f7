"""Lazy access to a checkpoint: ``mmapckpt.open`` (shaped like ``safetensors.safe_open``) and ``mmapckpt.load``.

Works on mmapckpt checkpoints and on stock DCP (``FileSystemWriter``) checkpoints.
In an mmapckpt checkpoint a tensor stored as one chunk is returned as a
copy-on-write view over the MAP_PRIVATE mapping of its shard file: nothing is
read until the bytes are used, the view keeps its mapping alive after the handle
is closed, and writing to it copies the touched pages and never changes the
file. Tensors stored as several chunks (saved from several ranks) are assembled
into one new tensor; slices read only the chunks and pages they need. Stock
items are read with ``torch.load(weights_only=True)``, one whole item at a time.

Inside this package ``open`` names the checkpoint opener, so no module may
``from .lazy import *``; file access lives in _chunks.py.
"""

from __future__ import annotations

import contextlib
import io
import mmap
import operator
import os
from typing import Any, Callable, Collection, Iterator, Union

import torch

from .errors import CheckpointError, FormatError
from .format.chunks import ChunkFiles, ChunkInfo, EntryInfo, check_coverage
from .format.entries import paused_gc
from .format.metadata import find_metadata, read_index_file
from .io.direct_reads import DirectReads
from .io.staging import StagingPool, check_device, stage, staging_options

__all__ = ["open", "load", "LazyCheckpoint", "TensorSlice", "EntryInfo", "ChunkInfo"]

KeySelector = Union[Collection[str], Callable[[str], bool], None]


def _ceil_div(a: int, b: int) -> int:
    return -((-a) // b)


def _normalize_index(index: Any, shape: tuple[int, ...]) -> tuple[list[tuple[int, int, int]], list[int]]:
    """Basic indexing -> per-dimension (start, step, count) and the shape of the result."""
    items = list(index) if isinstance(index, tuple) else [index]
    if sum(i is Ellipsis for i in items) > 1:
        raise IndexError("an index can only have a single ellipsis ('...')")
    if Ellipsis in items:
        at = items.index(Ellipsis)
        items[at:at + 1] = [slice(None)] * (len(shape) - (len(items) - 1))
    if len(items) > len(shape):
        raise IndexError(f"too many indices for tensor of dimension {len(shape)}")
    items += [slice(None)] * (len(shape) - len(items))
    sel, out_shape = [], []
    for dim, (it, size) in enumerate(zip(items, shape)):
        if isinstance(it, slice):
            start, stop, step = it.indices(size) if (it.step is None or it.step > 0) else (0, 0, 0)
            if step <= 0:
                raise ValueError("step must be greater than zero")
            n = max(0, _ceil_div(stop - start, step))
            sel.append((start, step, n))
            out_shape.append(n)
            continue
        if isinstance(it, bool) or it is None:
            raise TypeError(f"unsupported index {it!r}: use ints, slices and Ellipsis")
        try:
            i = operator.index(it)
        except TypeError:
            raise TypeError(f"unsupported index {it!r}: use ints, slices and Ellipsis") from None
        if not -size <= i < size:
            raise IndexError(f"index {i} is out of bounds for dimension {dim} with size {size}")
        sel.append((i % size, 1, 1))
    return sel, out_shape



class TensorSlice:
    """``handle.get_slice(name)``: index it to read part of a tensor (``[...]`` with ints, slices, Ellipsis)."""

    def __init__(self, ckpt: LazyCheckpoint, info: EntryInfo) -> None:
        self._ckpt, self._info = ckpt, info

    @property
    def shape(self) -> tuple[int, ...]:
        return self._info.shape  # type: ignore[return-value]

    @property
    def dtype(self) -> torch.dtype:
        return self._info.dtype  # type: ignore[return-value]

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def get_dtype(self) -> torch.dtype:
        return self.dtype

    def __getitem__(self, index: Any) -> torch.Tensor:
        """A new tensor holding ``full_tensor[index]``, read from only the chunks and pages it needs."""
        sel, out_shape = _normalize_index(index, self.shape)
        return self._ckpt._assemble(self._info, sel).view(out_shape)


class LazyCheckpoint:
    """An open checkpoint; see :func:`open`."""

    def __init__(self, path: str | os.PathLike[str], *, verify: bool = False) -> None:
        self.path = os.fspath(path)
        meta = find_metadata(self.path)
        self.kind, self._entries, save_id = read_index_file(meta)
        rels = {c.file for e in self._entries.values() for c in e.chunks}
        self._files: ChunkFiles | None = ChunkFiles(self.path, rels, save_id, verify=verify)
        self._covered: set[str] = set()

    # ------------------------------------------------------------------ safe_open-like surface
    def __enter__(self) -> LazyCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Forget the shard mappings. Tensors already returned keep theirs alive and stay valid."""
        self._files = None

    def keys(self) -> list[str]:
        """Every entry's fully-qualified name (tensors and objects), in the metadata's order."""
        return list(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def metadata(self, name: str) -> EntryInfo:
        """dtype, global shape and chunks of ``name``."""
        try:
            return self._entries[name]
        except KeyError:
            raise KeyError(f"{name!r} is not in the checkpoint at {self.path}") from None

    def get_tensor(self, name: str) -> torch.Tensor:
        """The full (unsharded) tensor ``name``, on the CPU.

        A tensor stored as one chunk of an mmapckpt checkpoint is a copy-on-write view
        over the file mapping (no byte read until used); otherwise a new tensor.

        Raises:
            KeyError: no such name.
            CheckpointError: ``name`` is not a tensor, or its stored bytes are inconsistent.
        """
        return self._tensor(self._tensor_info(name))

    def get_slice(self, name: str) -> TensorSlice:
        """A sliceable proxy for ``name``: ``get_slice(name)[2:, ::3]`` reads only what it needs."""
        return TensorSlice(self, self._tensor_info(name))

    def get_object(self, name: str, *, allow_unpickle: bool = False) -> Any:
        """The non-tensor value stored under ``name``.

        Such values are pickles: unpickling an untrusted file can run code, so this
        needs ``allow_unpickle=True`` (it then uses ``torch.load(weights_only=False)``, as DCP does).

        Raises:
            CheckpointError: ``allow_unpickle`` is not set, or ``name`` is a tensor.
        """
        info = self.metadata(name)
        if info.kind != "object":
            raise CheckpointError("entry is a tensor; use get_tensor()", path=self.path, entry=name)
        if not allow_unpickle:
            raise CheckpointError("entry is a pickled non-tensor value; loading it can run code from the file. "
                                  "Pass allow_unpickle=True if you trust this checkpoint", path=self.path, entry=name)
        data = self._open_files().object_bytes(info)
        try:
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)
        except Exception as e:
            raise FormatError(f"object could not be unpickled: {type(e).__name__}: {e}", path=self.path,
                              entry=name) from None

    # ------------------------------------------------------------------ internals
    def _open_files(self) -> ChunkFiles:
        if self._files is None:
            raise ValueError(f"I/O operation on a closed checkpoint handle ({self.path})")
        return self._files

    def _tensor_info(self, name: str) -> EntryInfo:
        info = self.metadata(name)
        if info.kind != "tensor":
            raise CheckpointError("entry is a pickled non-tensor value, not a tensor; use "
                                  "get_object(name, allow_unpickle=True) if you trust this checkpoint",
                                  path=self.path, entry=name)
        return info

    def _tensor(self, info: EntryInfo) -> torch.Tensor:
        c = info.whole
        if c is not None:  # a view, or a stock item loaded whole
            return self._open_files().chunk(info, c)
        return self._assemble(info, [(0, 1, s) for s in info.shape or ()])

    def _assemble(self, info: EntryInfo, sel: list[tuple[int, int, int]]) -> torch.Tensor:
        """A new tensor holding the selection (start, step, count per dim) across all chunks."""
        files = self._open_files()
        if info.name not in self._covered:
            check_coverage(info, self.path)
            self._covered.add(info.name)
        out = torch.empty([n for _, _, n in sel], dtype=info.dtype)
        if out.numel() == 0:
            return out
        for c in info.chunks:
            src, dst = [], []
            for (start, step, n), off, size in zip(sel, c.offsets, c.sizes):
                k0, k1 = max(0, _ceil_div(off - start, step)), min(n, _ceil_div(off + size - start, step))
                if k0 >= k1:
                    break
                src.append(slice(start + k0 * step - off, start + (k1 - 1) * step - off + 1, step))
                dst.append(slice(k0, k1))
            else:
                out[tuple(dst)].copy_(files.chunk(info, c)[tuple(src)])
        files.check_unchanged(info.chunks)
        return out


def open(path: str | os.PathLike[str], *, verify: bool = False) -> LazyCheckpoint:  # noqa: A001 - safe_open
    """Open a checkpoint directory (mmapckpt or stock DCP) for lazy reading.

    Args:
        path: the checkpoint directory (holding ``.metadata``).
        verify: check each mmapckpt entry's CRC-32 the first time it is read (reads all of
            its bytes; ChecksumError on a mismatch). Without it a flipped bit in the file is
            returned as it is. Stock DCP items carry no checksum.

    Returns:
        A :class:`LazyCheckpoint`, usable as a context manager.

    Raises:
        CheckpointError: no committed checkpoint at ``path``, or a damaged or foreign-endian file.

    Example:
        >>> with mmapckpt.open("/tmp/ckpt") as f:
        ...     w = f.get_tensor("layer.weight")          # a view: nothing read yet
        ...     rows = f.get_slice("embed.weight")[100:200]
    """
    return LazyCheckpoint(path, verify=verify)


def _select(names: list[str], keys: KeySelector, path: str) -> tuple[list[str], bool]:
    """The names ``keys`` selects, and whether they were named explicitly."""
    if keys is None:
        return names, False
    if callable(keys):
        return [n for n in names if keys(n)], False
    if isinstance(keys, str):
        raise TypeError("keys must be a collection of names or a predicate, not a single string")
    wanted = set(keys)
    missing = wanted.difference(names)
    if missing:
        raise KeyError(f"not in the checkpoint at {path}: {sorted(missing)}")
    return [n for n in names if n in wanted], True


def load(path: str | os.PathLike[str], *, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
         keys: KeySelector = None, allow_unpickle: bool = False, prefetch: bool = False, verify: bool = False,
         staging_bytes: int | None = None, staging_buffers: int | None = None,
         buffer_bytes: int | None = None, num_buffers: int | None = None) -> dict[str, Any]:
    """Load a checkpoint's full (unsharded) state dict as a flat ``{fqn: tensor}`` dict.

    On the CPU, tensors stored as one chunk of an mmapckpt checkpoint are copy-on-write
    views over the file mappings: the call costs time per tensor, not per byte, and
    memory is only used (as shared page cache) when the bytes are touched. On an
    accelerator the bytes are read from the files straight into ``staging_buffers`` pinned
    buffers of ``staging_bytes`` each, one filled while the last is copied; the result is
    synchronised. A flipped bit in the file is returned as it is unless ``verify=True``.

    Args:
        path: the checkpoint directory.
        device: where the tensors go.
        dtype: cast floating-point tensors to this dtype (others are kept as stored).
        keys: names to load, or a predicate on names; None loads every tensor.
        allow_unpickle: also load non-tensor entries (pickles; only for trusted files).
            Without it they are left out, and naming one in ``keys`` raises CheckpointError.
        prefetch: ask the kernel to start reading the selected tensors' pages now
            (MADV_WILLNEED); see docs/lazy.md for when that pays.
        verify: check the CRC-32 of every mmapckpt entry loaded (reads every byte, so a CPU
            load is no longer free of I/O; ChecksumError on a mismatch).
        staging_bytes, staging_buffers: the pinned staging ring for accelerator devices
            (default 3 buffers of 32 MiB, allocated for this call).
        buffer_bytes, num_buffers: deprecated names of ``staging_bytes`` and ``staging_buffers``.

    Returns:
        ``{fqn: tensor}`` (plus objects with ``allow_unpickle``), ready for
        ``model.load_state_dict(sd, assign=True)``.

    Example:
        >>> with torch.device("meta"):
        ...     model = MyModel()
        >>> model.load_state_dict(mmapckpt.load("/tmp/ckpt"), assign=True)
    """
    device = torch.device(device)
    check_device(device)
    nbytes, count = staging_options(staging_bytes, staging_buffers, buffer_bytes, num_buffers, "mmapckpt.load")
    with LazyCheckpoint(path, verify=verify) as ckpt:
        names, explicit = _select(ckpt.keys(), keys, ckpt.path)
        objects = [n for n in names if ckpt.metadata(n).kind == "object"]
        if objects and explicit and not allow_unpickle:
            ckpt.get_object(objects[0])  # raises the explanatory CheckpointError
        out: dict[str, Any] = {}
        tensors = [n for n in names if ckpt.metadata(n).kind == "tensor"]
        if prefetch:
            files = ckpt._open_files()
            for n in tensors:
                for c in ckpt.metadata(n).chunks:
                    files.advise(c, mmap.MADV_WILLNEED)
        if device.type == "cpu":
            with paused_gc():
                for n in tensors:
                    out[n] = ckpt._tensor(ckpt._entries[n])
        else:
            with StagingPool(device, staging_bytes=nbytes, staging_buffers=count) as pool:
                out.update(_load_to_device(ckpt, tensors, pool))
            pool.close()
        if dtype is not None:
            for n in tensors:
                if out[n].is_floating_point() and out[n].dtype != dtype:
                    out[n] = out[n].to(dtype)
        if allow_unpickle:
            for n in objects:
                out[n] = ckpt.get_object(n, allow_unpickle=True)
        return {n: out[n] for n in names if n in out}


def _load_to_device(ckpt: LazyCheckpoint, names: list[str], pool: StagingPool) -> dict[str, torch.Tensor]:
    """Every chunk through the staging pool into one device tensor per name (read from the files)."""
    out: dict[str, torch.Tensor] = {}
    with chunk_stager(ckpt, [ckpt.metadata(n) for n in names]) as stage_chunk:
        for n in names:
            info = ckpt.metadata(n)
            if info.whole is None:
                check_coverage(info, ckpt.path)
            t = torch.empty(info.shape or (), dtype=info.dtype, device=pool.device)
            for c in info.chunks:
                region = tuple(slice(o, o + s) for o, s in zip(c.offsets, c.sizes))
                stage_chunk(pool, info, c, t[region])
            out[n] = t
    return out


@contextlib.contextmanager
def chunk_stager(ckpt: LazyCheckpoint, infos: list[EntryInfo]) -> Iterator[Callable[..., None]]:
    """``stage_chunk(pool, info, chunk, dst, done=None)``: one stored chunk into accelerator tensor ``dst``.

    Chunks of mmapckpt shards are read from the file straight into the staging buffers
    (``preadv`` through :class:`DirectReads`, which also starts the kernel's readahead on a
    cold file); stock items are loaded and then staged. Used by ``load(device=...)`` and
    ``load_into`` with accelerator targets.
    """
    files = ckpt._open_files()
    chunks = [c for info in infos for c in info.chunks]
    ranges: dict[str, list[tuple[int, int]]] = {}
    for c in chunks:
        if c.file in files.shards and c.length:
            ranges.setdefault(c.file, []).append((c.file_offset, c.length))
    readers = {rel: DirectReads(files.shards[rel].file, ranges=sorted(r)) for rel, r in ranges.items()}

    def stage_chunk(pool: StagingPool, info: EntryInfo, c: ChunkInfo, dst: torch.Tensor,
                    done: Callable[[], None] = lambda: None) -> None:
        src = files.chunk(info, c)
        reader = readers.get(c.file)
        stage(pool, src, dst, done, reader.reader_for(src, info.name) if reader is not None else None)

    try:
        yield stage_chunk
    finally:
        for r in readers.values():
            r.close()
    files.check_unchanged(chunks)
