"""Starting the read of a CPU load's views before ``mmapckpt.load`` returns them (its default, ``prefetch=None``).

``load`` returns views over the files' mappings, and whoever calls it (not the lazy ``open``) wants every
selected byte. Touching views of a cold file faulted its pages in a readahead window at a time, one
window after another: a cold 1 GB checkpoint took longer to load and touch than safetensors' ``load_file``
(docs/benchmarks.md, "A fresh process"). So ``load`` advises each file holding the selection to be read in
order (``POSIX_FADV_SEQUENTIAL``) and asks the kernel to read the selected bytes now (``MADV_WILLNEED``),
one call per run of adjacent chunks; the kernel reads them while the caller goes on, and a touch waits
only for pages not yet in. On a cached file the advice finds every page there and reads nothing. It is
given only where the selection fits in half of the memory available, so that reading ahead never pushes
out pages it has just read (which the touch would then read a second time), and where it comes to at
least :data:`LEAST`; and it is advice: where a call fails, the load goes on as it did without it (each
page read when touched).
"""

from __future__ import annotations

import mmap
from typing import TYPE_CHECKING, Iterable

from ..format.entries import ChunkInfo
from ..io.files import available_memory

if TYPE_CHECKING:
    from ..format.entries import EntryInfo
    from .backend import ChunkBackend

__all__ = ["file_runs", "read_ahead", "LEAST"]

#: Selections shorter than this get no advice: their pages faulted in by the touch come in sooner, and a file
#: read ahead this way leaves the page cache slower to map for every warm load after it. Fresh processes,
#: cold ``load`` + touch of 323 tensors then a warm one, with and without the advice alternately (medians of
#: 6-8 pairs, development VM): 50 MB cold 52.0 against 43.0 ms, 80 MB 69.1 against 58.4 ms, 128 MB 92.8 against
#: 123.4 ms, 1 GB 384 against 428 ms (4 pairs); the warm loads after 23.5-29.5 against 17.9-23.5 ms at
#: every size.
LEAST = 96 << 20

#: Chunks of a file closer than this are advised in one call (the padding between them is read ahead anyway).
_GAP = 1 << 20


def file_runs(infos: Iterable[EntryInfo]) -> list[ChunkInfo]:
    """The stored chunks of ``infos`` (those with bytes at a place in a file), each file's merged into runs
    of adjacent bytes (gaps under ``_GAP``), as ranges of a file (``ChunkInfo((), (), file, offset, length)``),
    in file order."""
    by_file: dict[str, list[tuple[int, int]]] = {}
    for info in infos:
        for c in info.chunks:
            if c.length > 0 and c.file_offset >= 0:
                by_file.setdefault(c.file, []).append((c.file_offset, c.file_offset + c.length))
    runs = []
    for file in sorted(by_file):
        lo = hi = -1
        for a, b in sorted(by_file[file]):
            if lo >= 0 and a - hi <= _GAP:
                hi = max(hi, b)
                continue
            if lo >= 0:
                runs.append(ChunkInfo((), (), file, lo, hi - lo))
            lo, hi = a, b
        if lo >= 0:
            runs.append(ChunkInfo((), (), file, lo, hi - lo))
    return runs


def read_ahead(files: ChunkBackend, infos: Iterable[EntryInfo]) -> bool:
    """Advise the files holding the chunks of ``infos`` to be read in order and their bytes to be read now, a
    run of adjacent chunks at a time; False where nothing was asked (the selection is shorter than
    :data:`LEAST` or does not fit in half of the available memory) or a call failed (the rest is then read
    when touched, as without it)."""
    runs = file_runs(infos)
    total = sum(r.length for r in runs)
    if not runs or total < LEAST:
        return False
    avail = available_memory()
    if avail is None or total > avail // 2:
        return False
    for r in runs:
        try:
            files.advise(r, mmap.MADV_WILLNEED, sequential=True)
        except OSError:
            return False
    return True
