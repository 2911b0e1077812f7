"""The Hugging Face hub cache, as a local directory lays it out: which snapshot a repository names, and the
``blobs/`` its snapshot files link into.

``snapshot_download`` lays a repository out as ``models--ORG--NAME/{blobs/HASH, refs/,
snapshots/REV/...}``, each snapshot file a relative link ``../../blobs/HASH``. The format
registry (reading/formats.py, its ``hub-cache`` record) turns a repository into the snapshot
``refs/main`` names; ``LocalStorage`` follows a snapshot's links into its ``blobs/`` only.
"""

from __future__ import annotations

import os
import re

from ..errors import CheckpointNotFoundError
from ..io.files import within

__all__ = ["hub_blobs", "hub_snapshot", "is_hub_repository"]

#: The kinds of repository of a Hugging Face hub cache: models--ORG--NAME (also datasets--, spaces--).
_HUB_KINDS = ("models", "datasets", "spaces")


def _is_repo_name(name: str) -> bool:
    """Whether ``name`` is a hub cache repository's: a kind, ``--``, then at least one character (no newline)."""
    kind, dashes, rest = name.partition("--")
    return bool(dashes) and kind in _HUB_KINDS and rest != "" and "\n" not in rest


def hub_blobs(root: str) -> str | None:
    """The ``blobs/`` of the Hugging Face hub cache repository whose snapshot holds ``root`` (a real path), or None.

    ``snapshot_download`` lays a repository out as ``models--ORG--NAME/{blobs/HASH, refs/,
    snapshots/REV/...}``, each snapshot file a relative link ``../../blobs/HASH``. ``root`` is
    ``snapshots/REV`` or a directory below it. A file counts as in ``blobs`` by its real path,
    so a ``blobs`` that is itself a link to elsewhere admits nothing.
    """
    p = root
    while True:
        parent = os.path.dirname(p)
        if parent == p:
            return None
        if os.path.basename(parent) == "snapshots":
            repo = os.path.dirname(parent)
            blobs = os.path.join(repo, "blobs")
            return blobs if _is_repo_name(os.path.basename(repo)) and os.path.isdir(blobs) else None
        p = parent


#: A revision as refs/ files hold it (a commit hash; a name only, never a path).
_HUB_REVISION = r"[0-9A-Za-z][0-9A-Za-z._-]{0,254}"  # compiled by re on first use (a hub repository's)


def is_hub_repository(path: str) -> bool:
    """Whether ``path`` is the root of a repository of a Hugging Face hub cache (``models--ORG--NAME`` holding
    ``snapshots/``)."""
    return _is_repo_name(os.path.basename(os.path.normpath(path))) and \
        os.path.isdir(os.path.join(path, "snapshots"))


def hub_snapshot(repo: str) -> str | None:
    """The snapshot ``refs/main`` names, where ``repo`` is the root of a repository of a Hugging Face hub cache
    (``models--ORG--NAME`` holding ``snapshots/``); None for any other directory.

    Raises:
        CheckpointNotFoundError: a hub repository whose ``refs/main`` is missing, holds no revision name, or
            names a snapshot that is not there (or not inside ``snapshots/``).
    """
    if not is_hub_repository(repo):
        return None
    snapshots = os.path.join(repo, "snapshots")
    have = sorted(os.listdir(snapshots))
    fix = f"name a snapshot directory instead ({os.path.join(repo, 'snapshots', 'REV')}; here: {have or 'none'})"
    ref = os.path.join(repo, "refs", "main")
    try:
        with open(ref, "rb") as f:
            rev = f.read(256).decode("ascii").strip()
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointNotFoundError(f"hub cache repository without a readable refs/main ({e}): {fix}",
                                      path=repo) from None
    snap = os.path.join(snapshots, rev)
    if not re.fullmatch(_HUB_REVISION, rev) or not os.path.isdir(snap) or \
            not within(os.path.realpath(snapshots), os.path.realpath(snap)):
        raise CheckpointNotFoundError(f"hub cache refs/main names revision {rev[:80]!r}, which has no snapshot "
                                      f"here: {fix}", path=repo)
    return snap
