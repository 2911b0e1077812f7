"""DCP stream transforms (``_extensions`` / ``_extension_registry``): encoding and decoding one item.

DCP's ``StreamTransformExtension`` wraps a byte stream (zstd compression, encryption,
transforms of one's own); ``_StorageInfo.transform_descriptors`` names the transforms an
item was written through, and an ``ExtensionRegistry`` turns the names back into
transforms. Items written through them cannot be mapped in place: they are decoded into
memory (straight into the target where the whole chunk is wanted).

Descriptor order: a reader applies ``transform_from`` for each descriptor in list order,
each wrapping the stream before it, as ``FileSystemReader`` does. The writer records them so
that this undoes its wrapping (the first extension is the one next to the file).
"""

from __future__ import annotations

import io
from typing import Any, Callable, Iterable, Sequence

from ..errors import CheckpointError, FormatError

__all__ = ["StreamTransforms", "default_registry", "check_extensions", "decoded_limit"]

_PIECE = 8 << 20  # tensor bytes are fed to the transforms in pieces of this size


def _extension_module() -> Any:
    try:
        from torch.distributed.checkpoint import _extension
    except ImportError:  # torch before 2.7 has no stream transforms
        return None
    return _extension


def default_registry() -> Any:
    """A new ``ExtensionRegistry`` (knows ``ZStandard``), or None where this torch has none."""
    ext = _extension_module()
    return None if ext is None else ext.ExtensionRegistry()


def check_extensions(extensions: Any) -> tuple[Any, ...]:
    """``_extensions`` as a tuple of ``StreamTransformExtension`` instances; TypeError otherwise."""
    if not extensions:
        return ()
    ext = _extension_module()
    items = tuple(extensions)
    if ext is None or not all(isinstance(e, ext.StreamTransformExtension) for e in items):
        raise TypeError("_extensions must be a sequence of torch.distributed.checkpoint._extension."
                        f"StreamTransformExtension instances, got {[type(e).__name__ for e in items]}")
    return items


def decoded_limit(stored_length: int) -> int:
    """The most bytes a non-tensor item may decode to (a bound against decompression bombs)."""
    return max(256 << 20, 1024 * stored_length)


class _Sink(io.RawIOBase):
    """The innermost stream of an encoding: hands every written buffer on, never closes."""

    def __init__(self, put: Callable[[memoryview], None]) -> None:
        super().__init__()
        self._put = put

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        mv = memoryview(b).cast("B")
        if mv.nbytes:
            self._put(mv)
        return mv.nbytes

    def close(self) -> None:  # the transforms close what they wrap; the file stays the caller's
        pass


class _Source(io.RawIOBase):
    """A readable stream over a buffer (a mapped region) without copying it first."""

    def __init__(self, data: memoryview) -> None:
        super().__init__()
        self._data, self._pos = data.cast("B"), 0

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        out = memoryview(b).cast("B")
        n = min(out.nbytes, self._data.nbytes - self._pos)
        out[:n] = self._data[self._pos:self._pos + n]
        self._pos += n
        return n


class StreamTransforms:
    """The transforms of one writer (``extensions``) or one reader (``registry``)."""

    def __init__(self, extensions: Sequence[Any] = (), registry: Any = None) -> None:
        self.extensions = tuple(extensions)
        self.registry = registry if registry is not None else default_registry()

    @property
    def descriptors(self) -> tuple[str, ...]:
        return tuple(e.get_descriptor() for e in self.extensions)

    def encode(self, pieces: Iterable[Any], put: Callable[[memoryview], None]) -> tuple[str, ...]:
        """Write ``pieces`` through every extension, handing the encoded bytes to ``put``; return the descriptors."""
        stream: Any = _Sink(put)
        for e in self.extensions:
            stream = e.transform_to(stream)
        for p in pieces:
            mv = memoryview(p).cast("B")
            for i in range(0, mv.nbytes, _PIECE):
                stream.write(mv[i:i + _PIECE])
        stream.flush()
        stream.close()
        return self.descriptors

    def decode(self, stored: memoryview | bytes, descriptors: Sequence[str], *, path: str, entry: str,
               into: memoryview | None = None, limit: int | None = None) -> bytes | None:
        """Undo ``descriptors`` on ``stored``.

        With ``into`` (exactly the decoded length): decode straight into it and return None.
        Otherwise return the decoded bytes (at most ``limit`` of them).

        Raises:
            CheckpointError: a transform this reader's registry does not know.
            FormatError: the stored bytes do not decode, or decode to the wrong length.
        """
        stream: Any = _Source(memoryview(stored))
        for t in self._transforms(descriptors, path, entry):
            stream = t.transform_from(stream)
        try:
            if into is not None:
                _read_exactly(stream, into.cast("B"), path, entry)
                return None
            return _read_bounded(stream, decoded_limit(len(stored)) if limit is None else limit, path, entry)
        except CheckpointError:
            raise
        except Exception as e:  # a transform's own error: damaged or foreign bytes
            raise FormatError(f"stored bytes do not decode through {list(descriptors)}: {type(e).__name__}: {e}"[:500],
                              path=path, entry=entry) from None

    def _transforms(self, descriptors: Sequence[str], path: str, entry: str) -> list[Any]:
        if self.registry is None:
            raise CheckpointError(f"entry was written through stream transforms {list(descriptors)}, which this "
                                  "torch version does not have (torch 2.7 or later)", path=path, entry=entry)
        try:
            ts = list(self.registry.from_descriptor_list(list(descriptors)))
        except Exception as e:
            raise CheckpointError(f"entry was written through stream transforms {list(descriptors)}, which this "
                                  f"reader cannot undo ({e}): pass MmapReader(path, _extension_registry=registry) "
                                  "with their classes registered", path=path, entry=entry) from None
        ext = _extension_module()
        return [t for t in ts if isinstance(t, ext.StreamTransformExtension)]


def _read_exactly(stream: Any, out: memoryview, path: str, entry: str) -> None:
    pos = 0
    while pos < out.nbytes:
        n = _read_into(stream, out[pos:])
        if not n:
            raise FormatError(f"stored bytes decode to {pos} bytes, the entry holds {out.nbytes}", path=path,
                              entry=entry)
        pos += n
    if stream.read(1):
        raise FormatError(f"stored bytes decode to more than the entry's {out.nbytes} bytes", path=path, entry=entry)


def _read_into(stream: Any, out: memoryview) -> int:
    """``readinto`` where the transform's stream has it, else ``read``."""
    if hasattr(stream, "readinto"):
        return stream.readinto(out) or 0
    b = stream.read(min(out.nbytes, _PIECE))
    out[:len(b)] = b
    return len(b)


def _read_bounded(stream: Any, limit: int, path: str, entry: str) -> bytes:
    out = bytearray()
    while True:
        b = stream.read(min(_PIECE, limit + 1 - len(out)))
        if not b:
            return bytes(out)
        out += b
        if len(out) > limit:
            raise FormatError(f"stored bytes decode to more than {limit} bytes; refusing a likely "
                              "decompression bomb", path=path, entry=entry)
