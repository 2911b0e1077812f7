"""The checkpoint directory's commits: where the metadata lives, and what an overwrite removes."""

from __future__ import annotations

import glob
import os

from ..errors import CheckpointWriteError
from ..format.metadata import METADATA_NAME
from ..io.files import fsync_dir

__all__ = ["SHARD_SUFFIX", "metadata_path", "rank_commits", "invalidate", "remove_stale_shards"]

SHARD_SUFFIX = ".distcp"


def metadata_path(path: str, rank: int | None) -> str:
    """The commit file: ``.metadata``, or ``__{rank}.metadata`` for a save with use_collectives=False."""
    name = METADATA_NAME if rank is None else f"__{rank}{METADATA_NAME}"
    return os.path.join(path, name)


def rank_commits(path: str) -> list[str]:
    """Per-rank metadata files (``__{rank}.metadata``) of a save made with use_collectives=False."""
    return glob.glob(os.path.join(glob.escape(path), f"__*{METADATA_NAME}"))


def invalidate(path: str, meta: str, *, sync: bool) -> None:
    try:
        os.unlink(meta)
        if sync:
            fsync_dir(path)
    except FileNotFoundError:
        return
    except OSError as e:
        raise CheckpointWriteError(f"cannot remove the previous checkpoint's metadata: {e}", path=meta) from e


def remove_stale_shards(path: str, referenced: set[str]) -> None:
    """Drop shard files of an overwritten checkpoint that the new one does not use,
    and temporary files left by earlier saves that were killed (this save's are renamed by now)."""
    d = glob.escape(path)
    leftovers = glob.glob(os.path.join(d, f".__*_*{SHARD_SUFFIX}.tmp-*")) + glob.glob(
        os.path.join(d, f".{METADATA_NAME}.tmp-*"))
    for p in glob.glob(os.path.join(d, f"__*_*{SHARD_SUFFIX}")) + leftovers:
        if os.path.basename(p) not in referenced:
            try:
                os.unlink(p)
            except OSError:
                pass
