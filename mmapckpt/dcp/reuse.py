"""What a save with ``MmapWriter(path, reuse=[...])`` may refer to: the chunks its sibling steps hold.

The steps of a managed root (a directory or prefix holding ``.mmapckpt-root``, docs/manager.md)
are ordinary checkpoints ``ROOT/step-{N}/``. A save of one step with ``reuse`` names committed
sibling steps; :func:`reuse_index` reads their metadata and the headers of the shard files it
names (each opened the one way every reader opens a data file, its save id checked: a file a
step refers to in turn is checked against the save id that step recorded for it) and keeps, per
(fqn, chunk offsets), the content hash each header recorded and where the bytes are, named from
the step being written (``../step-M/FILE``, the file that holds them, never a chain of references).
writing/dedup.py compares each chunk with it.

A :class:`HeaderCache` (one per ``CheckpointManager``) keeps what each save wrote into its shard headers
(the chunks' hashes, as the writer encoded them) and what it read of others, by the file's reference
and the save id that the reused step's metadata (read every time) records for it, for as long as the
file has the size and preamble it was written or read with: a manager's later saves decode no header
of the files it wrote, and any other once. Headers are decoded with the cyclic collector paused
(format/entries.paused_gc): their many small objects otherwise set off full collections that took
0.2-0.5 s of a save here. Beside each chunk's hash the cache keeps the chunk's equality tag where the
manager knows it (writing/tags.py, under the cache's own key): the tag of the bytes it wrote, or found equal
to the stored ones; a later save compares such a chunk by its tag alone.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from importlib.util import find_spec
from typing import Any, Mapping

from ..errors import CheckpointError, CheckpointWriteError
from ..format import layout as fmt
from ..format.entries import ROOT_MARKER, paused_gc, reference_parts
from ..format.metadata import KIND_MMAPCKPT
from ..reading.shard import file_save_id, open_named, shard_of
from ..storage.base import CheckpointStorage
from ..storage.commits import read_index
from ..storage.local import LocalStorage
from ..storage.location import is_url
from ..writing.dedup import Reusable, ReuseIndex, require_hasher
from ..writing.tags import Tagger

#: Stored bytes are compared in pieces of this size (each hashed while it is in cache).
_PIECE = 1 << 20

__all__ = ["HeaderCache", "reuse_index", "in_managed_root", "step_name", "save_index", "references"]


_Hashes = dict[Any, tuple["str | None", int, "int | None", "bytes | None"]]


class HeaderCache:
    """The content hashes read from reused shard headers, kept from one save to the next (``CheckpointManager``'s).

    A file's are looked up by (root, ``../step-M/FILE``, the save id the reused step's metadata, read again for
    every save, records for it) and used only while the file has the size and the first bytes (its preamble:
    the header's length and CRC-32) they were read with; otherwise its header is read and checked again. What
    one save did not use is dropped at the next. ``tagger``: the equality tags' key (None without ``cryptography``,
    and for a cache no later save reads: ``tags=False``), which never leaves the process."""

    def __init__(self, *, tags: bool = True) -> None:
        self._kept: dict[tuple[str, str, str], tuple[Any, _Hashes]] = {}
        self._used: dict[tuple[str, str, str], tuple[Any, _Hashes]] = {}
        self.tagger = Tagger.make() if tags else None

    def hashes(self, key: tuple[str, str, str], stamp: Any, read: Callable[[], _Hashes]) -> _Hashes:
        """The hashes of the file ``key`` names, now of size and preamble ``stamp``: kept, else ``read()``."""
        got = self._used.get(key) or self._kept.get(key)
        if got is None or got[0] != stamp:
            got = (stamp, read())
        self._used[key] = got
        return got[1]

    def wrote(self, storage: CheckpointStorage, save_id: str, written: Mapping[str, tuple[Any, _Hashes]]) -> None:
        """The shard files a save at ``storage`` (a step of the root) wrote, with what their headers hold
        (``ReuseIndex.written``): the next save reads them from here, as long as the files are as written."""
        root, step = storage.sibling("").location, step_name(storage.location)
        for name, (stamp, hashes) in written.items():
            self._used[(root, f"../{step}/{name}", save_id)] = (stamp, hashes)

    def next_save(self) -> None:
        """Keep only what the last save used (called as a save starts to build its index)."""
        self._kept, self._used = self._used, {}


def save_index(storage: CheckpointStorage, reuse: Sequence[str], cache: HeaderCache | None = None,
               ) -> ReuseIndex | None:
    """What a save at ``storage`` compares its chunks with (``MmapWriter(reuse=...)``): the ``reuse`` steps'
    chunks; none, but every chunk hashed so that the next step can match by hash, for a step of a managed root
    saved without ``reuse`` (its first step: where ``blake3`` is installed), on every medium: the chunks that
    stay frozen from the first step on (a frozen tower, a reference model) are then matched by the hashes on
    disk, by every later save and after every restart, and never compared byte for byte (hash on second sight
    is for the chunks written by later saves of a local root); None (no hashing: a save outside a root costs
    nothing more) otherwise."""
    if reuse:
        return reuse_index(storage, reuse, cache)
    if in_managed_root(storage) and find_spec("blake3") is not None:
        # hash_written: the first step of a root is hashed (and tagged, for the same manager's next save), on a
        # local disk too
        return ReuseIndex({}, {}, tagger=cache.tagger if cache is not None else None)
    return None


def _reads_cheaply(storage: CheckpointStorage) -> bool:
    """Whether a save can read the stored bytes of the root to compare (a local disk), rather than an object
    store's GETs: there, written chunks carry no hash and an unhashed stored chunk is compared byte for byte."""
    return isinstance(storage, LocalStorage)


def _comparer(storage: CheckpointStorage) -> Callable[[Reusable, Any], str | None]:
    """``ReuseIndex.compare`` for a save at ``storage``: the BLAKE3 hash of ``buf`` where it equals, byte for byte,
    the stored chunk ``r`` (read through the reference, as a reader opens it), else None."""
    def compare(r: Reusable, buf: Any) -> str | None:
        from blake3 import blake3
        mv, h = memoryview(buf).cast("B"), blake3()
        with open_named(storage, r.file, None) as f:
            if r.offset + r.length > f.size or len(mv) != r.length:
                return None
            piece, o = bytearray(min(_PIECE, r.length)), 0
            while o < r.length:  # the head first: a chunk that changed differs there, mostly (one small read)
                n = min(fmt.HEAD_BYTES if o == 0 else _PIECE, r.length - o)
                p = piece if n == len(piece) else bytearray(n)  # a bytearray: compared by memcmp (not per item)
                f.read_into(r.offset + o, p)
                if p != mv[o:o + n]:
                    return None
                h.update(p)
                o += n
        return h.hexdigest()
    return compare


def references(storage_data: Mapping[Any, Any], index: Callable[[], ReuseIndex | None]) -> dict[str, str]:
    """What a commit's ``storage_meta.references`` records (docs/format.md 3.4): the save id of each sibling
    step's file its records refer to; empty where none do. Every rank refers only to the reused steps' files,
    whose save ids ``index()`` holds."""
    refs = {info.relative_path for info in storage_data.values() if info.relative_path.startswith("../")}
    if not refs:
        return {}
    ix = index()
    assert ix is not None  # only a save with reuse= records references (an invariant of ours)
    return {r: ix.save_ids[r] for r in sorted(refs)}


def step_name(location: str) -> str:
    """The last part of a location (a step directory's name)."""
    return location.replace("\\", "/").rstrip("/").rsplit("/", 1)[-1]


def in_managed_root(storage: CheckpointStorage) -> bool:
    """Whether the location's parent holds the root marker (a step of a managed root)."""
    try:
        return storage.sibling("").exists(ROOT_MARKER)
    except CheckpointError:  # no parent, or a medium without siblings
        return False


def _same_place(a: str, b: str) -> bool:
    if is_url(a) or is_url(b):
        return a.rstrip("/") == b.rstrip("/")
    return os.path.realpath(a) == os.path.realpath(b)


def reuse_index(storage: CheckpointStorage, paths: Sequence[str | os.PathLike[str]],
                cache: HeaderCache | None = None) -> ReuseIndex:
    """The chunks the steps ``paths`` hold, for a save at ``storage`` to refer to (hashing needs ``blake3``);
    ``cache``: the headers read by the same manager's earlier saves.

    Raises:
        CheckpointWriteError: blake3 missing; the location is not a step of a managed root; a path is not a
            committed sibling step ``step-{N}`` of it (or is the step itself).
        CheckpointError: a reused step is damaged (as any reader of it would raise).
    """
    require_hasher(storage.location)
    here = step_name(storage.location)
    if not in_managed_root(storage):
        raise CheckpointWriteError(f"reuse= refers to sibling steps, which only a managed root allows: its parent has "
                                   f"no {ROOT_MARKER} (CheckpointManager writes it)", path=storage.location)
    chunks: dict[tuple[str, tuple[int, ...]], Reusable] = {}
    save_ids: dict[str, str] = {}
    cache = cache or HeaderCache(tags=False)  # tags only where a manager keeps the cache for its next save
    cache.next_save()
    root = storage.sibling("").location
    local = _reads_cheaply(storage)
    stored: dict[str, dict[Any, Any]] = {}
    for p in paths:
        name = step_name(os.fspath(p))
        if reference_parts(f"../{name}/x") is None or name == here:
            raise CheckpointWriteError(f"reuse= names {os.fspath(p)!r}: not a sibling step directory step-N of this "
                                       "one", path=storage.location)
        step = storage.sibling(name)
        if not _same_place(step.location, os.fspath(p)):
            raise CheckpointWriteError(f"reuse= names {os.fspath(p)!r}, which is not in this step's root",
                                       path=storage.location)
        with paused_gc():  # many small objects, freed before the collector resumes (see the module's docstring)
            _index_step(step, name, here, chunks, save_ids, cache, root, stored, local)
    return ReuseIndex(chunks, save_ids, hash_written=not local, compare=_comparer(storage) if local else None,
                      stored=stored, tagger=cache.tagger)


def _index_step(step: CheckpointStorage, name: str, here: str, chunks: dict[Any, Reusable],
                save_ids: dict[str, str], cache: HeaderCache, root: str, stored: dict[str, dict[Any, Any]],
                local: bool) -> None:
    kind, entries, save_id = read_index(step)
    if kind != KIND_MMAPCKPT:
        raise CheckpointWriteError("reuse= names a stock DCP checkpoint; only mmapckpt steps record content hashes",
                                   path=step.location)
    by_file: dict[str, list[tuple[Any, ...]]] = {}
    for e in entries.values():
        if e.kind != "tensor":
            continue
        dt = fmt.dtype_name(e.dtype)
        for c in e.chunks:
            if c.length:
                by_file.setdefault(c.file, []).append(((e.name, c.offsets), c.file_offset, c.length, dt, c.sizes))
    for rel, recs in by_file.items():
        ref = rel if rel.startswith("../") else f"../{name}/{rel}"  # the file holding the bytes, from us
        if reference_parts(ref) is None or ref.startswith(f"../{here}/"):
            continue  # a file of the step being written (it is being replaced): nothing to refer to
        sid = file_save_id(save_id, rel)
        if sid is None:
            continue  # no save id to check a reference by: write those chunks again
        hashes = stored[ref] = _hashes(step, rel, save_id, sid, cache, (root, ref, sid), local)
        for key, offset, length, dt, sizes in recs:
            h = hashes.get(key)
            if h is not None and h[1] == offset and (h[0] is not None or h[3] is not None or local):
                chunks[key] = Reusable(h[0], ref, offset, length, dt, sizes, h[2], h[3])
        save_ids[ref] = sid


def _hashes(step: CheckpointStorage, rel: str, save_id: Any, sid: str, cache: HeaderCache,
            key: tuple[str, str, str], unhashed: bool) -> _Hashes:
    """The content hashes of data file ``rel`` of ``step``, its header checked whole and its save id ``sid``
    (unless ``cache`` holds them for the file as it is now)."""
    with open_named(step, rel, save_id) as f:
        stamp = (f.size, bytes(f.read(0, min(fmt.PREAMBLE_SIZE, f.size))))

        def read() -> _Hashes:
            shard = shard_of(f, sid, stock=False, check_entries=True, referenced=True)
            assert shard is not None  # stock=False (an invariant of ours)
            return {k: (*h, None) for k, h in shard.hashes(unhashed=unhashed).items()}  # no tag: not ours

        return cache.hashes(key, stamp, read)
