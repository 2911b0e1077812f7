"""Lazy access to a checkpoint: ``mmapckpt.open`` (shaped like ``safetensors.safe_open``) and ``mmapckpt.load``.

Works on every checkpoint ``reading/locate.py`` finds: mmapckpt and stock DCP (``FileSystemWriter``) directories,
safetensors files and Hugging Face directories (sharded with an index, or one ``model.safetensors``), and
``torch.save`` files. A tensor stored as one chunk in an mmapckpt shard or a safetensors file is returned as a
copy-on-write view over the MAP_PRIVATE mapping of its file: nothing is read until the bytes are used, the view
keeps its mapping alive after the handle is closed, and writing to it copies the touched pages and never changes
the file. Tensors stored as several chunks (saved from several ranks) are assembled into one new tensor; slices
read only the chunks and pages they need. Stock DCP items are read with ``torch.load(weights_only=True)``, one
whole item at a time.

The formats differ only in their chunk backend (``reading/backend.py``: ``reading/chunks.py`` ``ChunkFiles``,
``reading/safetensors_files.py`` ``SafetensorsFiles``, ``reading/torchfile.py`` ``TorchFiles``). Inside this
package ``open`` names the checkpoint opener, so no module may ``from .lazy import *``.
"""

from __future__ import annotations

import io
import mmap
import os
from typing import TYPE_CHECKING, Any, Callable, Collection, Iterator, Mapping, Union, overload

import torch

from .errors import CheckpointError, FormatError
from .format.entries import ChunkInfo, EntryInfo, paused_gc
from .reading.backend import ChunkBackend
from .reading.locate import open_backend
from .storage.base import StoredFile
from .io.staging_options import DEFAULT_STAGING_BUFFERS, DEFAULT_STAGING_BYTES, check_device, staging_options

if TYPE_CHECKING:  # the pipeline (io/staging.py) is imported by loads onto an accelerator only; where used (load_into
    from .io.staging import StagingPool  # needs none): reading/regions, keys, read_ahead, format/aliases, casts

__all__ = ["open", "load", "read_tensors", "LazyCheckpoint", "TensorSlice", "EntryInfo", "ChunkInfo"]

KeySelector = Union[Collection[str], Callable[[str], bool], None]

#: torch dtype -> safetensors' dtype code (what ``get_slice(name).get_dtype()`` returns), made on first use: a
#: load of another format imports no safetensors module
_CODES: dict[torch.dtype, str] = {}
_FRAMEWORKS = ("pt", "torch", "numpy", "np")


def dtype_code(dtype: torch.dtype) -> str:
    """safetensors' name of ``dtype`` (``"BF16"``, ``"F32"``, ...); torch's name for a dtype
    safetensors cannot store (``"complex128"``)."""
    if not _CODES:
        from .format.safetensors import SAFETENSORS_DTYPES

        _CODES.update({d: code for code, d in SAFETENSORS_DTYPES.items()})
    return _CODES.get(dtype) or str(dtype).removeprefix("torch.")


class TensorSlice:
    """``handle.get_slice(name)``: index it to read part of a tensor (``[...]`` with ints, slices, Ellipsis).

    Args:
        ckpt: the open checkpoint the slice reads from (made by ``get_slice``, not by hand).
        info: the entry it reads.
    """

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

    def get_dtype(self) -> str:
        """The dtype as ``safe_open``'s slices name it: ``"F32"``, ``"BF16"``, ``"F8_E4M3"``, ...
        (the attribute ``dtype`` is the torch dtype)."""
        return dtype_code(self._info.dtype)  # type: ignore[arg-type]

    def __getitem__(self, index: Any) -> Any:
        """A new tensor (a numpy array with ``framework="numpy"``) holding ``full_tensor[index]``,
        read from only the chunks and pages it needs."""
        from .reading.regions import normalize_index, read_selection
        sel, out_shape = normalize_index(index, self.shape)
        t = read_selection(self._ckpt.backend, self._info, sel).view(out_shape)
        return self._ckpt._returned(t, self._info.name)


class LazyCheckpoint:
    """An open checkpoint; see :func:`open`, which takes the same arguments.

    Args:
        path: the checkpoint directory or file (kept as the attribute ``path``).
        framework: ``"pt"`` (or ``"torch"``), or ``"numpy"`` (or ``"np"``).
        device: where ``get_tensor`` and slices return tensors (kept as the attribute ``device``).
        verify: check each mmapckpt entry's CRC-32 the first time it is read.
        storage_options: settings of an object store's client (docs/object-storage.md).
        strip_prefix: remove this prefix from the names that start with it (see :func:`open`).

    Attributes:
        kind: its format: ``"mmapckpt"``, ``"dcp"``, ``"safetensors"`` or ``"torch"``.
    """

    def __init__(self, path: str | os.PathLike[str], framework: str = "pt", device: str | torch.device = "cpu", *,
                 verify: bool = False, storage_options: Mapping[str, Any] | None = None,
                 strip_prefix: str | None = None) -> None:
        if framework not in _FRAMEWORKS:
            raise ValueError(f"framework {framework!r} is not supported: pass framework='pt' (or 'torch') for "
                             "torch tensors, or 'numpy' (or 'np') for numpy arrays")
        self.device = torch.device(device)
        self._numpy = framework in ("numpy", "np")
        if self._numpy and self.device.type != "cpu":
            raise ValueError(f"framework={framework!r} returns numpy arrays, which live on the CPU: "
                             f"device={str(self.device)!r} is not possible")
        check_device(self.device)
        self._to = None if self.device.type == "cpu" else self.device  # one test per get_tensor on the CPU
        self.path = os.fspath(path)
        with paused_gc():  # the index's objects and each file's records (format/entries.paused_gc)
            opened = open_backend(self.path, verify=verify, storage_options=storage_options)
        self.kind, self._entries, self._user_metadata = opened.kind, opened.entries, opened.user_metadata
        self._files: ChunkBackend | None = opened.files
        if strip_prefix is not None:  # entries keep their stored names (EntryInfo.name), for messages
            try:
                from .reading.keys import strip_names
                renamed = strip_names(list(self._entries), strip_prefix, self.path)
            except BaseException:
                self.close()
                raise
            self._entries = {new: self._entries[old] for new, old in renamed.items()}

    # ------------------------------------------------------------------ safe_open-like surface
    def __enter__(self) -> LazyCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Release the files. Tensors already returned keep their mappings alive and stay valid."""
        files, self._files = self._files, None
        if files is not None:
            files.close()

    def keys(self) -> list[str]:
        """Every entry's fully-qualified name (tensors and objects), in the metadata's order
        (sorted, as ``safe_open``'s, for safetensors files and Hugging Face directories)."""
        return list(self._entries)

    def offset_keys(self) -> list[str]:
        """The names in the order their bytes lie in the files (by file, then offset), as
        ``safe_open(...).offset_keys()``: reading in this order reads each file front to back."""
        return sorted(self._entries, key=lambda n: min(((c.file, c.file_offset) for c in self._entries[n].chunks),
                                                       default=("", 0)))

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    @overload
    def metadata(self) -> dict[str, str] | None: ...

    @overload
    def metadata(self, name: str) -> EntryInfo: ...

    def metadata(self, name: str | None = None) -> dict[str, str] | EntryInfo | None:
        """The user metadata ``{str: str}`` (None where there is none), as ``safe_open(...).metadata()``:
        a safetensors ``__metadata__`` (the first file's winning over a Hugging Face index) or what
        ``mmapckpt.save(..., metadata=...)`` kept; None for stock DCP and torch.save files.
        ``metadata(name)`` is the old spelling of :meth:`info`."""
        if name is None:
            return self._user_metadata()
        return self.info(name)

    def info(self, name: str) -> EntryInfo:
        """dtype, global shape and chunks of ``name`` (where each chunk lies in which file)."""
        try:
            return self._entries[name]
        except KeyError:
            raise KeyError(f"{name!r} is not in the checkpoint at {self.path}") from None

    def get_tensor(self, name: str) -> torch.Tensor:
        """The full (unsharded) tensor ``name``, on the handle's device.

        On the CPU, a tensor stored as one chunk of an mmapckpt checkpoint, or at an offset
        that is a multiple of its element size in a safetensors file, is a copy-on-write view
        over the file mapping (no byte read until used); otherwise a new tensor. A torch.save
        file's tensors are returned as ``torch.load(mmap=True)`` built them.

        Raises:
            KeyError: no such name.
            CheckpointError: ``name`` is not a tensor, or its stored bytes are inconsistent.
        """
        from .reading.regions import read_tensor
        info = self.tensor_info(name)
        return self._returned(read_tensor(self.backend, info), info.name)

    def get_tensors(self) -> dict[str, Any]:
        """Every tensor entry, as ``{name: get_tensor(name)}`` in :meth:`offset_keys` order (as
        ``safe_open(...).get_tensors()``); non-tensor entries are left out (use :meth:`get_object`)."""
        return {n: self.get_tensor(n) for n in self.offset_keys() if self._entries[n].kind == "tensor"}

    def _returned(self, t: torch.Tensor, stored: str) -> Any:
        """``t`` as the handle's framework and device give it back (numpy shares the CPU memory)."""
        if self._numpy:
            try:
                return t.numpy()
            except TypeError:  # bfloat16, float8, ...: torch says "unsupported ScalarType"
                raise TypeError(f"{self.path}: entry {stored!r} is {dtype_code(t.dtype)} ({t.dtype}), which numpy "
                                "has no dtype for: open it with framework='pt' to get a torch tensor") from None
        return t if self._to is None else t.to(self._to)

    def get_slice(self, name: str) -> TensorSlice:
        """A sliceable proxy for ``name``: ``get_slice(name)[2:, ::3]`` reads only what it needs;
        ``get_shape()`` gives a list and ``get_dtype()`` safetensors' dtype code, as ``safe_open``'s."""
        return TensorSlice(self, self.tensor_info(name))

    def get_object(self, name: str, *, allow_unpickle: bool = False) -> Any:
        """The non-tensor value stored under ``name``.

        In a DCP checkpoint such values are pickles: unpickling an untrusted file can run
        code, so this needs ``allow_unpickle=True`` (it then uses
        ``torch.load(weights_only=False)``, as DCP does). A torch.save file's values were
        already loaded with ``weights_only=True`` and need no ``allow_unpickle``.

        Raises:
            CheckpointError: ``allow_unpickle`` is not set, or ``name`` is a tensor.
        """
        info = self.info(name)
        if info.kind != "object":
            raise CheckpointError("entry is a tensor; use get_tensor()", path=self.path, entry=name)
        if not self.backend.pickled_objects:
            return self.backend.object_value(info)
        if not allow_unpickle:
            raise CheckpointError("entry is a pickled non-tensor value; loading it can run code from the file. "
                                  "Pass allow_unpickle=True if you trust this checkpoint", path=self.path, entry=name)
        data = self.backend.object_bytes(info)
        try:
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)
        except Exception as e:
            raise FormatError(f"object could not be unpickled: {type(e).__name__}: {e}", path=self.path,
                              entry=name) from None

    @property
    def backend(self) -> ChunkBackend:
        """The open checkpoint's chunk backend (``reading/backend.py``): what the loaders read chunks through.

        Raises:
            ValueError: the handle is closed.
        """
        if self._files is None:
            raise ValueError(f"I/O operation on a closed checkpoint handle ({self.path})")
        return self._files

    def tensor_info(self, name: str) -> EntryInfo:
        """:meth:`info` of a tensor entry.

        Raises:
            KeyError: no such name.
            CheckpointError: ``name`` holds a non-tensor value.
        """
        info = self.info(name)
        if info.kind != "tensor":
            raise CheckpointError("entry is a pickled non-tensor value, not a tensor; use "
                                  "get_object(name, allow_unpickle=True) if you trust this checkpoint",
                                  path=self.path, entry=name)
        return info


def open(path: str | os.PathLike[str], framework: str = "pt", device: str | torch.device = "cpu", *,
         verify: bool = False, storage_options: Mapping[str, Any] | None = None,
         strip_prefix: str | None = None) -> LazyCheckpoint:
    """Open a checkpoint for lazy reading, as ``safetensors.safe_open(path, framework, device)`` does.

    Args:
        path: an mmapckpt or stock DCP checkpoint directory (holding ``.metadata``); a
            ``.safetensors`` file; a Hugging Face directory (``model.safetensors.index.json``
            and its shards, or one ``model.safetensors``; else ``pytorch_model.bin.index.json``
            and its shards, or one ``pytorch_model.bin``), also a hub cache snapshot or its
            repository root ``models--ORG--NAME`` (the snapshot ``refs/main`` names); or a
            ``torch.save`` file (read with ``torch.load(weights_only=True, mmap=True)``).
        framework: ``"pt"`` (or ``"torch"``) for torch tensors; ``"numpy"`` (or ``"np"``) for
            numpy arrays sharing the tensors' memory (CPU only; a dtype numpy lacks, such as
            bfloat16 or float8, raises TypeError naming the entry); anything else raises ValueError.
        device: where ``get_tensor`` and ``get_slice(...)[...]`` return tensors. On the CPU
            they are views where the format allows; on an accelerator each is copied there
            (use :func:`load` with ``device=`` for a whole state dict: it streams through
            pinned buffers). An unavailable device raises RuntimeError at once.
        verify: check each mmapckpt entry's CRC-32 the first time it is read (reads all of
            its bytes; ChecksumError on a mismatch). Without it a flipped bit in the file is
            returned as it is. Only mmapckpt checkpoints have checksums: for stock DCP,
            safetensors and torch.save files ``verify`` checks nothing more (their structure,
            headers and bounds are checked on open either way).
        storage_options: for a ``path`` on an object store (``s3://BUCKET/PREFIX``), the settings
            of its client (credentials, endpoint, request sizes; docs/object-storage.md),
            overriding the ``AWS_*`` environment; ignored for a local path.
        strip_prefix: remove this prefix (e.g. ``"model."``) from the names that start with it,
            keeping the others as they are: ``keys()`` and every lookup use the new names. As
            ``convert --strip-prefix``, it raises CheckpointError when no name starts with it,
            when stripping leaves a name empty or starting with ``.``, or makes two names one.

    Returns:
        A :class:`LazyCheckpoint`, usable as a context manager; ``metadata()`` gives the user
        metadata (``{str: str}`` or None) and ``info(name)`` an entry's dtype, shape and chunks.

    Raises:
        CheckpointError: no checkpoint at ``path``, or a damaged, hostile or foreign-endian file.

    Example:
        >>> with mmapckpt.open("/tmp/ckpt") as f:
        ...     w = f.get_tensor("layer.weight")          # a view: nothing read yet
        ...     rows = f.get_slice("embed.weight")[100:200]
    """
    return LazyCheckpoint(path, framework, device, verify=verify, storage_options=storage_options,
                          strip_prefix=strip_prefix)


def _select(names: list[str], keys: KeySelector, path: str) -> tuple[list[str], set[str]]:
    """The names ``keys`` selects, and those of them named explicitly (spelled as a pattern)."""
    if keys is None:
        return names, set()
    if callable(keys):
        return [n for n in names if keys(n)], set()
    from .reading.keys import check_patterns, pick
    pats = check_patterns(keys)
    chosen, unmatched = pick(names, pats)
    if unmatched:
        raise KeyError(f"not in the checkpoint at {path} (keys are glob patterns on its names, case-sensitive): "
                       f"{unmatched}")
    return chosen, set(pats).intersection(names)


def load(path: str | os.PathLike[str], *, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
         keys: KeySelector = None, allow_unpickle: bool = False, prefetch: bool | None = None, verify: bool = False,
         staging_bytes: int | None = None, staging_buffers: int | None = None,
         buffer_bytes: int | None = None, num_buffers: int | None = None,
         storage_options: Mapping[str, Any] | None = None, strip_prefix: str | None = None,
         allow_cast: bool = False) -> dict[str, Any]:
    """Load a checkpoint's full (unsharded) state dict as a flat ``{fqn: tensor}`` dict.

    Every format :func:`open` takes is accepted, with the same result for the same tensors.
    On the CPU, tensors stored as one chunk of an mmapckpt checkpoint (or aligned in a
    safetensors file) are copy-on-write views over the file mappings: the call costs time
    per tensor, not per byte (on a cold file it asks the kernel to read the selection ahead,
    ``prefetch``), and memory is used as shared page cache, not anonymous memory, until a view
    is written to. On an accelerator the bytes are read from the files straight into
    ``staging_buffers`` pinned buffers of ``staging_bytes`` each, one filled while the last
    is copied; the result is synchronised. A flipped bit in the file is returned as it is
    unless ``verify=True`` (mmapckpt checkpoints only: the other formats have no checksums).

    Args:
        path: a checkpoint directory or file (see :func:`open`).
        device: where the tensors go.
        dtype: cast floating-point tensors to this dtype (others are kept as stored). A finite value
            outside ``dtype``'s range (float32 ``1e30`` into float16, which would become inf) raises
            CastError naming the entry, unless ``allow_cast``; rounding is what a cast is for and is
            never refused (docs/lazy.md, "Casts").
        keys: glob patterns of the names to load, as ``convert --keys`` takes them (``fnmatch``,
            case-sensitive, ``*`` also matches dots: ``["model.layers.0.*", "lm_head.weight"]``),
            or a predicate on names; None loads every tensor. A pattern that matches no name
            raises KeyError. With ``strip_prefix`` they match the stored names, as in ``convert``.
        allow_unpickle: also load non-tensor entries (pickles; only for trusted files).
            Without it they are left out, and naming one in ``keys`` raises CheckpointError
            (a torch.save file's values too, so that every format gives the same dict).
        prefetch: None (the default): on the CPU, ask the kernel to read the selected tensors' bytes now, in
            file order (POSIX_FADV_SEQUENTIAL, then MADV_WILLNEED on each run of adjacent chunks), where they
            come to at least 96 MiB (reading/read_ahead.LEAST) and fit in half of the available memory; the call
            returns without waiting and a touch waits only for pages not yet read. True: MADV_WILLNEED on every
            chunk, on any device. False: no hint, every page is read when first touched. See docs/lazy.md for the
            measurements.
        verify: check the CRC-32 of every mmapckpt entry loaded (reads every byte, so a CPU
            load is no longer free of I/O; ChecksumError on a mismatch). Stock DCP, safetensors
            and torch.save files have no checksums: for them it checks nothing more.
        staging_bytes: the size of each buffer of the pinned staging ring for accelerator
            devices (allocated for this call).
        staging_buffers: the number of buffers in that ring.
        buffer_bytes: deprecated name of ``staging_bytes``.
        num_buffers: deprecated name of ``staging_buffers``.
        storage_options: settings of an object store's client (see :func:`open`).
        strip_prefix: remove this prefix from the selected names that start with it (see
            :func:`open`): ``load(p, keys=["model.*"], strip_prefix="model.")`` gives a training
            checkpoint's model under the names ``model.state_dict()`` has.
        allow_cast: cast with ``dtype`` even values outside its range (they become inf, as
            ``Tensor.to`` makes them).

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
    with LazyCheckpoint(path, verify=verify, storage_options=storage_options) as ckpt:
        names, explicit = _select(ckpt.keys(), keys, ckpt.path)
        named_objects = [n for n in names if n in explicit and ckpt.info(n).kind == "object"]
        if named_objects and not allow_unpickle:
            if ckpt.backend.pickled_objects:
                ckpt.get_object(named_objects[0])  # raises the explanatory CheckpointError
            raise CheckpointError("entry is a non-tensor value: pass allow_unpickle=True to include such values",
                                  path=ckpt.path, entry=named_objects[0])
        if strip_prefix is not None:
            from .reading.keys import strip_names
            new_names = {old: new for new, old in strip_names(names, strip_prefix, ckpt.path).items()}
        tensors = [n for n in names if ckpt.info(n).kind == "tensor"]
        out: dict[str, Any] = read_tensors(ckpt, tensors, device, prefetch=prefetch, staging_bytes=nbytes,
                                           staging_buffers=count)
        if dtype is not None:
            from .format.casts import check_cast
            cast: dict[int, torch.Tensor] = {}  # tied names: one tensor, cast once
            for n in tensors:
                t = out[n]
                if t.is_floating_point() and t.dtype != dtype:
                    if id(t) not in cast:
                        check_cast(t, t.dtype, dtype, allow_cast=allow_cast, path=ckpt.path, entry=ckpt.info(n).name,
                                   fix="pass allow_cast=True to cast anyway, or leave dtype out")
                        cast[id(t)] = t.to(dtype)
                    out[n] = cast[id(t)]
        if allow_unpickle:
            for n in names:
                if ckpt.info(n).kind == "object":
                    out[n] = ckpt.get_object(n, allow_unpickle=True)
        if strip_prefix is not None:
            return {new_names[n]: out[n] for n in names if n in out}
        return {n: out[n] for n in names if n in out}


def read_tensors(ckpt: LazyCheckpoint, names: list[str], device: torch.device, *, prefetch: bool | None = None,
                 staging_bytes: int = DEFAULT_STAGING_BYTES,
                 staging_buffers: int = DEFAULT_STAGING_BUFFERS) -> dict[str, torch.Tensor]:
    """The tensor entries ``names`` of the open ``ckpt`` on ``device``, as stored: what :func:`load` and
    ``load_model`` read. Names that are one stored tensor (tied weights, ``format/aliases.py``) are one tensor
    object in the result. On the CPU, views over the mappings where the format allows; on an accelerator,
    through a staging pool of ``staging_buffers`` pinned buffers of ``staging_bytes`` made for this call.
    ``prefetch``: True, MADV_WILLNEED on every chunk; None, on the CPU, the files advised to be read in order and
    the selection's runs read ahead where they fit in memory and reach ``read_ahead.LEAST``; False, neither."""
    from .format.aliases import shared_names
    from .reading.regions import read_tensor
    out: dict[str, torch.Tensor] = {}
    if prefetch:
        files = ckpt.backend
        for n in names:
            for c in ckpt.info(n).chunks:
                files.advise(c, mmap.MADV_WILLNEED)
    elif prefetch is None and device.type == "cpu":
        from .reading.read_ahead import read_ahead
        read_ahead(ckpt.backend, [ckpt.info(n) for n in names])
    if device.type == "cpu":
        with paused_gc():
            files = ckpt.backend
            # tensors stored whole in an object (no mapping to view): read into new tensors in one batch
            fetched = []
            for n in names:
                info = ckpt.info(n)
                if info.whole is not None and isinstance(files.mapped(info, info.whole), StoredFile):
                    fetched.append((n, torch.empty(info.shape or (), dtype=info.dtype), info))
            if fetched:  # the reading machinery (reading/fill.py, its reads and threads): only for objects
                from .reading.fill import fill_targets

                fill_targets(files, fetched)
                out.update((n, t) for n, t, _ in fetched)
            for n in names:
                if n not in out:
                    out[n] = read_tensor(files, ckpt.info(n))
    else:
        from .io.staging import StagingPool

        with StagingPool(device, staging_bytes=staging_bytes, staging_buffers=staging_buffers) as pool:
            out.update(_load_to_device(ckpt, names, pool))
        pool.close()
    for alias, first in shared_names(ckpt._entries, names).items():  # tied weights: one tensor again
        out[alias] = out[first]
    return out


def _load_to_device(ckpt: LazyCheckpoint, names: list[str], pool: StagingPool) -> dict[str, torch.Tensor]:
    """Every chunk through the staging pool into one device tensor per name (read from the files, reading/stager.py)."""
    from .reading.stager import chunk_stager

    out: dict[str, torch.Tensor] = {}
    with chunk_stager(ckpt.backend, [ckpt.info(n) for n in names]) as stage_chunk:
        for n in names:
            info = ckpt.info(n)
            t = torch.empty(info.shape or (), dtype=info.dtype, device=pool.device)
            for c in info.chunks:
                region = tuple(slice(o, o + s) for o, s in zip(c.offsets, c.sizes))
                stage_chunk(pool, info, c, t[region])
            out[n] = t
    return out
