"""A regular file opened read-only and mapped copy-on-write, with tensor views at offsets.

Knows nothing of the format: callers say where a tensor's bytes lie. A view never
reaches past the end of the file as it was when mapped (a file truncated later can
still raise SIGBUS when touched: :meth:`MappedFile.check_unchanged` tells).
"""

from __future__ import annotations

import mmap
import os
import stat
import weakref
from typing import TYPE_CHECKING

from ..errors import CheckpointError, IncompleteCheckpointError, TruncatedFileError
from .files import is_cached

if TYPE_CHECKING:
    import torch

__all__ = ["MappedFile", "open_regular"]


def open_regular(path: str) -> int:
    """Open ``path`` read-only; refuse anything but a regular file (a FIFO would block, a device never ends)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise IncompleteCheckpointError("shard file is missing", path=path) from None
    except OSError as e:
        raise CheckpointError(f"cannot open shard: {e.strerror}", path=path) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CheckpointError("shard is not a regular file", path=path)
    return fd


class MappedFile:
    """The first ``size`` bytes (default: all) of the open descriptor ``fd``, mapped MAP_PRIVATE (readable and writable).

    Writable private pages let torch build ordinary tensors over them: writing to one
    copies that page and never changes the file. The mapping holds its own reference to
    the file, so ``fd`` may be closed afterwards.

    Attributes:
        path: the file's path (for messages).
        size: its size when mapped.
        ident: (st_dev, st_ino) of the file mapped, so that a descriptor opened later can
            be checked to be the same file.
    """

    def __init__(self, fd: int, path: str, size: int | None = None) -> None:
        st = os.fstat(fd)
        self.path, self.ident = path, (st.st_dev, st.st_ino)
        # A descriptor of this very file, for reads beside the mapping (io/direct_reads.py): never the path
        # again, which a rename may since have given to another file. Closed with the mapping.
        self._fd = os.dup(fd)
        weakref.finalize(self, os.close, self._fd)
        self.size = st.st_size if size is None else size
        self._mmap: mmap.mmap | None = None
        if self.size:
            try:
                self._mmap = mmap.mmap(fd, self.size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            except (OSError, ValueError) as e:
                raise CheckpointError(f"cannot map file: {e}", path=path) from None
        # One buffer export for the whole file; views are slices of it. Made on first use, so that a file
        # opened only for its header (inspect) imports no torch.
        self._base_t: torch.Tensor | None = None
        self._typed: dict[torch.dtype, torch.Tensor] = {}

    @property
    def _base(self) -> torch.Tensor | None:
        if self._base_t is None and self._mmap is not None:
            import torch

            self._base_t = torch.frombuffer(self._mmap, dtype=torch.uint8)
        return self._base_t

    def dup(self) -> int:
        """A new descriptor of the file mapped (the caller closes it)."""
        return os.dup(self._fd)

    def address(self) -> int:
        """The address of the file's first byte in the mapping (0 for an empty file)."""
        return 0 if self._base is None else self._base.data_ptr()

    def view(self, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """A contiguous tensor of ``dtype`` and ``shape`` whose bytes start at ``offset`` (no copy).

        The caller has checked that the bytes lie inside the file and that ``offset`` is a
        multiple of the dtype's size.
        """
        if self._mmap is None or 0 in shape:
            import torch

            return torch.empty(shape, dtype=dtype)
        base = self._typed.get(dtype)
        if base is None:
            itemsize = dtype.itemsize
            base = self._typed[dtype] = self._base[:self.size - self.size % itemsize].view(dtype)  # type: ignore[index]
        if len(shape) == 1:
            return base.as_strided(shape, (1,), offset // dtype.itemsize)
        return base.as_strided(shape, _contiguous_strides(shape), offset // dtype.itemsize)

    def raw(self, offset: int, length: int) -> torch.Tensor:
        """``length`` bytes at ``offset`` as a uint8 view (no copy)."""
        if length == 0 or self._mmap is None:
            import torch

            return torch.empty(0, dtype=torch.uint8)
        return self._base[offset:offset + length]  # type: ignore[index]

    def memory(self, offset: int, length: int) -> memoryview:
        """``length`` bytes at ``offset`` as a memoryview of the mapping (no copy, no torch)."""
        if length == 0 or self._mmap is None:
            return memoryview(b"")
        return memoryview(self._mmap)[offset:offset + length]

    def advise(self, advice: int, offset: int, length: int, *, sequential: bool = False) -> None:
        """Pass a madvise hint for the pages holding ``length`` bytes at ``offset``; ``sequential``: first advise
        the file to be read in order (``POSIX_FADV_SEQUENTIAL``: twice the kernel's readahead window).

        ``MADV_WILLNEED`` of bytes found cached is not given: the kernel would look up every page of them to find
        each there (0.2 ms of a warm load of a 50 MB checkpoint here, every time). They count as cached where a one-byte
        probe that cannot wait for the disk finds each of up to ``_PROBES`` places spread over them in the page
        cache (io/files.py ``is_cached``, as ``load_into`` tells a cached file); a cold file's first probe fails.
        """
        if self._mmap is None or not length:
            return
        if advice == mmap.MADV_WILLNEED and is_cached(self._fd, _probes(offset, length)):
            return
        if sequential:
            os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        start = offset - offset % mmap.PAGESIZE
        self._mmap.madvise(advice, start, offset + length - start)

    def check_unchanged(self) -> None:
        """Raise if the mapped file shrank since it was mapped (touching those pages would SIGBUS).

        The mapping holds its own descriptor, so this checks the same inode even if the
        path was since replaced by a rename.
        """
        if self._mmap is None:
            return
        now = self._mmap.size()
        if now < self.size:
            raise TruncatedFileError(f"file shrank from {self.size} to {now} bytes while it was being read",
                                     path=self.path)


#: At most this many places of a range are probed before its read-ahead advice (about 2 us each).
_PROBES = 32


def _probes(offset: int, length: int) -> list[int]:
    """Up to ``_PROBES`` offsets spread evenly over ``length`` bytes at ``offset``, its first and last byte included."""
    step = max(mmap.PAGESIZE, length // (_PROBES - 1))
    return [*range(offset, offset + length - 1, step), offset + length - 1]


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, acc = [], 1
    for d in reversed(shape):
        out.append(acc)
        acc *= d
    return tuple(reversed(out))
