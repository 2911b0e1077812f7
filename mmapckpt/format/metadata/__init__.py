"""The checkpoint metadata file (``.metadata``): encoding without pickle, and safe reading.

One module a part, bottom to top (the layering is an import-linter contract, pyproject.toml):

- framing.py: the preamble (magic, version, length, CRC), the kinds, the body's JSON and its
  ``user_metadata``;
- index.py: what every decoder returns (``MetaIndex``: the entries, ``EntryInfo`` records);
- v2_columns.py: the version-2 table of the common shape, checked and built column by column
  (the v2 decoder's way of reading that shape);
- v1.py, v2.py, stock.py: one decoder each (version 1, version 2 the entry table, stock DCP's
  pickle), and the encoders of versions 1 and 2;
- codec.py: the entry points, which pick the encoder and decoder by kind and version.

Every decoder returns the format's own index (``EntryInfo``/``ChunkInfo`` records), and importing
this package imports no ``torch.distributed``: DCP's ``Metadata`` is built from the index by the
DCP adapter (``dcp/records.py``, ``dcp/metadata.py``). Only a stock DCP ``.metadata`` (a pickle of
DCP's classes) imports ``torch.distributed.checkpoint`` when it is read, since its restricted
unpickler admits exactly those classes.

docs/format.md, section 3, is the specification.
"""

from .codec import decode_built, decode_index, decode_index_file, encode_metadata
from .framing import (
    KIND_MMAPCKPT,
    KIND_STOCK,
    MAX_METADATA_SIZE,
    META_MAGIC,
    METADATA_NAME,
    check_user_metadata,
    decode_user_metadata,
    metadata_kind,
)
from .framing import META_MAJOR as META_MAJOR  # public constants of the old module, outside its __all__
from .framing import META_MINOR as META_MINOR
from .framing import META_MINOR_USER as META_MINOR_USER
from .framing import USER_METADATA_KEY as USER_METADATA_KEY
from .index import MetaIndex

__all__ = [
    "METADATA_NAME",
    "META_MAGIC",
    "encode_metadata",
    "check_user_metadata",
    "decode_user_metadata",
    "MetaIndex",
    "decode_index",
    "decode_built",
    "decode_index_file",
    "metadata_kind",
    "MAX_METADATA_SIZE",
    "KIND_MMAPCKPT",
    "KIND_STOCK",
]
