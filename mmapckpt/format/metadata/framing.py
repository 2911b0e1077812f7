"""The framing of a ``.metadata`` file: what both versions share around their body.

::

    offset 0   magic     8 bytes  b"\\xffMMAPMD\\n"   (0xff is no pickle opcode: the stock
                                                     reader fails at once, running nothing)
    offset 8   major     u16      2 (1: the older body, still read)
    offset 10  minor     u16      0 (a version-1 body with ``user_metadata``: 1)
    offset 12  body_crc  u32      CRC-32 (zlib) of the body
    offset 16  body_len  u64
    offset 24  body      a UTF-8 JSON object (docs/format.md, section 3)

Here: the preamble (magic, version, length, CRC), which kind of checkpoint a file's first
bytes announce (mmapckpt's or stock DCP's pickle), the JSON parse of the body, and the
body's ``user_metadata`` key, which is the same in every version.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from typing import Any

from ...errors import BadMagicError, FormatError, UnsupportedVersionError
from ..crc import crc32

__all__ = [
    "METADATA_NAME", "META_MAGIC", "META_PREAMBLE", "META_MAJOR", "META_MINOR", "META_MINOR_USER", "META_MINOR_REFS",
    "MAX_METADATA_SIZE", "KIND_MMAPCKPT", "KIND_STOCK", "USER_METADATA_KEY", "frame", "major_of", "body_of",
    "parse_body", "metadata_kind", "check_user_metadata", "decode_user_metadata",
]

METADATA_NAME = ".metadata"
META_MAGIC = b"\xffMMAPMD\n"
#: Version 2 stores the entries as a table (v2.py); version 1 files (v1.py) are read as before.
META_MAJOR = 2
META_MINOR = 0
#: The minor version of a metadata file that carries ``user_metadata`` (an optional key: 1.0 readers ignore it).
META_MINOR_USER = 1
#: The minor version of a version-2 file whose ``storage_meta`` has ``references`` (cross-step references:
#: a 2.0 reader refuses their ``../`` names as paths leaving the checkpoint, and never misreads them).
META_MINOR_REFS = 1
USER_METADATA_KEY = "user_metadata"
META_PREAMBLE = struct.Struct("<8sHHIQ")
#: A metadata file larger than this is refused before it is read.
MAX_METADATA_SIZE = 1 << 30
KIND_MMAPCKPT = "mmapckpt"
KIND_STOCK = "dcp"


def frame(major: int, minor: int, body: bytes) -> bytes:
    """The file: the preamble, then ``body``."""
    return META_PREAMBLE.pack(META_MAGIC, major, minor, crc32(body), len(body)) + body


def major_of(data: bytes) -> int:
    """The major version of a file :func:`body_of` accepted."""
    return META_PREAMBLE.unpack_from(data)[1]


def body_of(data: bytes, path: str) -> bytes:
    """The body of a file's bytes, its magic, version, length and CRC checked; FormatError naming ``path``."""
    if len(data) < META_PREAMBLE.size or data[:8] != META_MAGIC:
        raise BadMagicError("not an mmapckpt metadata file", path=path)
    _, major, _minor, crc, blen = META_PREAMBLE.unpack_from(data)
    if major not in (1, META_MAJOR):
        raise UnsupportedVersionError(f"metadata version {major}; this mmapckpt reads versions 1.x and "
                                      f"{META_MAJOR}.x", path=path)
    body = data[META_PREAMBLE.size:]
    if len(body) != blen:
        raise FormatError(f"metadata body is {len(body)} bytes, its preamble says {blen}", path=path)
    if crc32(body) != crc:
        raise FormatError("metadata checksum mismatch: the file is damaged", path=path)
    return body


def parse_body(body: bytes) -> tuple[Any, bool]:
    """The body's document, and whether all its numbers are integers and it holds no ``true``/``false``.

    The hooks run only for floats, NaN and infinities, so the answer costs nothing an entry
    beyond two scans of the text (a ``true`` inside a string also says False: only slower).
    Raises what ``json.loads`` raises (UnicodeDecodeError and RecursionError too).
    """
    other: list[str] = []

    def note(s: str) -> float:
        other.append(s)
        return float(s)

    doc = json.loads(body.decode("utf-8"), parse_float=note, parse_constant=note)
    return doc, not other and b"true" not in body and b"false" not in body


def metadata_kind(head: bytes) -> str | None:
    """Which kind of checkpoint a metadata file's first bytes announce, if any."""
    if head.startswith(META_MAGIC):
        return KIND_MMAPCKPT
    if head[:1] == b"\x80":  # pickle protocol 2+
        return KIND_STOCK
    return None


def check_user_metadata(metadata: Any) -> dict[str, str] | None:
    """``metadata`` as a plain ``{str: str}`` dict (None stays None); anything else raises TypeError.

    The same rule as ``safetensors.torch.save_file(metadata=...)``: only strings, so that the
    values round-trip through a safetensors header and never need pickle.
    """
    if metadata is None:
        return None
    if not isinstance(metadata, Mapping):
        raise TypeError(f"metadata must be a dict of str to str, got {type(metadata).__name__}")
    for k, v in metadata.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise TypeError(f"metadata must be a dict of str to str; {k!r}: {v!r} is a "
                            f"{type(k).__name__}: {type(v).__name__} (convert values with str() or json.dumps)")
    return dict(metadata)


def decode_user_metadata(kind: str, data: bytes, p: str) -> dict[str, str] | None:
    """The user metadata ({str: str}) a ``.metadata`` file's bytes carry, or None when it has none.

    Stock DCP metadata (a pickle) has no such field: None. A damaged file, or a
    ``user_metadata`` that is not an object of strings, raises FormatError naming the file.
    """
    if kind != KIND_MMAPCKPT:
        return None
    body = body_of(data, p)
    try:
        doc = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise FormatError(f"metadata is not valid JSON: {e}", path=p) from None
    if type(doc) is not dict:
        raise FormatError("invalid metadata: metadata must be a JSON object", path=p)
    user = doc.get(USER_METADATA_KEY)
    if user is None:
        return None
    if type(user) is not dict or not all(type(v) is str for v in user.values()):
        raise FormatError(f"invalid metadata: {USER_METADATA_KEY!r} must be an object of strings", path=p)
    return user
