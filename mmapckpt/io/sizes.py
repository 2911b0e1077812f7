"""Sizes as people write them: ``"5GB"``, ``"500MiB"``, ``1000`` (``convert --max-shard-size``).

Pure (no torch), so the command line checks a size while it parses its arguments.
"""

from __future__ import annotations

import re

__all__ = ["parse_size"]

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)\s*$", re.IGNORECASE)
_UNIT = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
         "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_size(size: int | str) -> int:
    """``'5GB'`` -> 5*10**9, ``'512MiB'`` -> 512*2**20, ``1000`` -> 1000 (the Hugging Face convention)."""
    if isinstance(size, int) and not isinstance(size, bool):
        n = size
    else:
        m = _SIZE.match(str(size))
        if not m:
            raise ValueError(f"invalid size {size!r}; use e.g. 5GB, 500MB, 2GiB or a number of bytes")
        unit = m.group(2).lower()
        unit = unit[:-1] if unit.endswith("b") and unit != "b" else unit
        n = int(float(m.group(1)) * _UNIT[unit])
    if n <= 0:
        raise ValueError(f"size must be positive, got {size!r}")
    return n
