"""One mapped shard file: validated header, tensors as views over the mapping.

The header and every entry's bounds are checked against the file's size before
anything is mapped, so a view never reaches past the end of the file as it was
when opened (a file truncated later can still raise SIGBUS: see docs/reliability.md).
"""

from __future__ import annotations

import mmap
import os
import stat
import zlib

import torch

from . import format as fmt
from ._io import pread_into
from .errors import CheckpointError, ChecksumError, IncompleteCheckpointError, TruncatedFileError

__all__ = ["Shard", "is_mmapckpt_shard"]


def _open_regular(path: str) -> int:
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


def is_mmapckpt_shard(path: str) -> bool:
    fd = _open_regular(path)
    try:
        return os.pread(fd, len(fmt.MAGIC), 0) == fmt.MAGIC
    except OSError as e:
        raise CheckpointError(f"cannot read shard: {e.strerror}", path=path) from None
    finally:
        os.close(fd)


class Shard:
    """A validated, mapped mmapckpt shard file.

    Attributes:
        path: the file's path.
        header: its decoded header.
        size: its size when opened.
        ident: (st_dev, st_ino) of the file when opened.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        fd = _open_regular(path)
        try:
            st = os.fstat(fd)
            self.size = st.st_size
            self.ident = (st.st_dev, st.st_ino)  # lets a reader check that a descriptor it opens is this file
            pre = os.pread(fd, fmt.PREAMBLE_SIZE, 0)
            minor, order, hlen, hcrc = fmt.decode_preamble(pre, self.size, path)
            body = bytearray(hlen)
            pread_into(fd, body, fmt.PREAMBLE_SIZE, path=path)
            self.header = fmt.decode_header(bytes(body), header_crc=hcrc, byte_order=order, minor=minor,
                                            file_size=self.size, path=path)
            # Map the descriptor the header was read from, never the path again: a file
            # renamed over the path in between would pair this header with other bytes.
            self._mmap = _map_fd(fd, self.size, path)
        except OSError as e:
            raise CheckpointError(f"cannot read shard: {e.strerror or e}", path=path) from None
        finally:
            os.close(fd)
        self._entries = self.header.by_key()
        # One buffer export for the whole file; entries are slices of it.
        self._base = torch.frombuffer(self._mmap, dtype=torch.uint8) if self._mmap is not None else None

    def entry(self, fqn: str, chunk_offsets: tuple[int, ...] | None) -> fmt.Entry:
        try:
            return self._entries[(fqn, chunk_offsets)]
        except KeyError:
            label = fqn if chunk_offsets is None else f"{fqn}@{list(chunk_offsets)}"
            raise CheckpointError("entry is not in this shard's header", path=self.path, entry=label) from None

    def raw(self, e: fmt.Entry) -> torch.Tensor:
        """The entry's bytes as a uint8 view over the mapping (no copy)."""
        if e.length == 0 or self._base is None:
            return torch.empty(0, dtype=torch.uint8)
        return self._base[e.offset:e.offset + e.length]

    def tensor(self, e: fmt.Entry) -> torch.Tensor:
        """The entry as a tensor of its dtype and shape, a copy-on-write view over the mapping."""
        dtype = fmt.DTYPES[e.dtype][0]  # type: ignore[index]
        if e.length == 0:
            return torch.empty(e.shape, dtype=dtype)
        return self.raw(e).view(dtype).view(e.shape)

    def read_bytes(self, e: fmt.Entry) -> bytes:
        return self.raw(e).numpy().tobytes()

    def verify(self, e: fmt.Entry) -> None:
        """Raise ChecksumError if the entry's bytes do not match their CRC-32."""
        got = zlib.crc32(self.raw(e).numpy()) if e.length else 0
        if got != e.crc32:
            raise ChecksumError(f"CRC-32 of the data is {got:08x}, the header says {e.crc32:08x}",
                                path=self.path, entry=e.label)


def _map_fd(fd: int, size: int, path: str) -> mmap.mmap | None:
    """Map ``size`` bytes of ``fd`` copy-on-write (MAP_PRIVATE, readable and writable).

    Writable private pages let torch build ordinary tensors over them: writing to
    one copies that page and never changes the file. Returns None for ``size`` 0.
    """
    if size == 0:
        return None
    try:
        return mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot map file: {e}", path=path) from None


def check_size_unchanged(shard: Shard) -> None:
    """Raise if the mapped file shrank since it was opened (touching those pages would SIGBUS).

    The mapping holds its own descriptor, so this checks the same inode even if the
    path was since replaced by a rename.
    """
    if shard._mmap is None:
        return
    now = shard._mmap.size()
    if now < shard.size:
        raise TruncatedFileError(f"file shrank from {shard.size} to {now} bytes while it was being read",
                                 path=shard.path)
