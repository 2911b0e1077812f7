"""A save's shard files: which entries go to which file, and the files written, all or none.

Both savers use it: ``MmapWriter`` (dcp/writer.py, for ``dcp.save``), whose DCP items become
entries in dcp/shard_writer.py, and ``mmapckpt.save`` (saving.py), which builds its entries from
a flat ``{name: tensor}`` dict without DCP. Each file is written by the one shard writer
(writing/shard.py), ``thread_count`` files at a time; then the directory is made durable. If any
file fails, the files this save finished are removed again (no commit will name them).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..format import layout as fmt
from ..storage.base import CheckpointStorage
from .dedup import ReuseIndex
from .shard import ShardEntry, ShardOptions, write_shard

__all__ = ["ShardFile", "split_by_size", "write_files", "how_written"]

#: One file to write: its name, its entries (in file order), and ``{i: j}`` exact aliases among them.
ShardFile = tuple[str, Sequence[ShardEntry], Mapping[int, int] | None]


def split_by_size(n: int, sizes: Sequence[int | None]) -> list[list[int]]:
    """Spread entries over ``n`` files of similar byte counts: the positions each file gets (greedy, largest
    first; ``None``, a small non-tensor payload, round robin). Files left empty are dropped."""
    if n == 1:
        return [list(range(len(sizes)))] if sizes else []
    buckets: list[list[int]] = [[] for _ in range(n)]
    total = [0] * n
    payloads = [i for i, s in enumerate(sizes) if s is None]
    for k, i in enumerate(payloads):
        buckets[k % n].append(i)
    for i in sorted((i for i, s in enumerate(sizes) if s is not None), key=lambda i: sizes[i], reverse=True):
        k = total.index(min(total))
        buckets[k].append(i)
        total[k] += sizes[i]  # type: ignore[operator]
    return [b for b in buckets if b]


def write_files(storage: CheckpointStorage, files: Sequence[ShardFile], resolve: Callable[[Any], Any], *,
                save_id: str, options: ShardOptions, thread_count: int, write_paths: dict[str, str],
                reuse: ReuseIndex | None = None) -> list[list[fmt.Entry]]:
    """Write ``files`` (``thread_count`` at a time), then make the directory durable (``options.sync``).

    Returns each file's written entries (writing/shard.py ``write_shard``: offset, length, CRC-32; with
    ``reuse``, a ``Reference`` for a chunk equal to a stored one). ``write_paths`` receives each written
    file's name and how its bytes travelled (a file whose every chunk is referenced is not written).
    """
    def one(f: ShardFile) -> list[fmt.Entry]:
        name, entries, aliases = f
        done, how = write_shard(storage, name, entries, resolve, save_id=save_id, options=options,
                                aliases=aliases, reuse=reuse)
        if how != "referenced":
            write_paths[name] = how
        return done

    try:
        if thread_count > 1 and len(files) > 1:
            with ThreadPoolExecutor(thread_count, thread_name_prefix="mmapckpt-write") as pool:
                per_file = list(pool.map(one, files))
        else:
            per_file = [one(f) for f in files]
        if options.sync and files:
            storage.sync()
    except BaseException:
        storage.remove(list(write_paths), sync=False)  # every file of this save (the pool has joined its threads)
        raise
    return per_file


def how_written(write_paths: Mapping[str, str]) -> str | None:
    """How a save wrote its shards (``write_files``' ``write_paths``): "direct", "buffered", "encoded", "mixed",
    or None (no file written)."""
    kinds = set(write_paths.values())
    return None if not kinds else kinds.pop() if len(kinds) == 1 else "mixed"
