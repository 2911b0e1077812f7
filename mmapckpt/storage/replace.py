"""Replacing a file or a directory so that its path holds the old or the new one at every instant.

A single file goes through ``os.replace`` (the temp file is already durable), then an
fsync of the directory. A directory is swapped with ``renameat2(RENAME_EXCHANGE)``:
one atomic step exchanges the new tree (built beside the old one) with the old. Where
the kernel, libc or file system refuses the exchange, the old tree is renamed aside and
the new one renamed in, under a journal (``.{name}.replace-journal`` beside the path)
that :func:`recover` reads: a path found missing gets its old tree back; one found
replaced gets the aside tree retired.

Only the entries the caller names as ``owned`` (the previous version's own files) and
the names the new tree holds are replaced. Every other entry of the old directory
(configs, notes, subdirectories) is hard-linked (copied where links are refused) into
the new tree before the swap, so no instant lacks it; retiring the old tree unlinks
only entries that are the same file as their counterpart, moves back one that has none
(created during the swap) and leaves any other in place, reported to the caller.

Nothing here knows a checkpoint format.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import os
import re
import shutil
import socket
import uuid
from typing import Any, Iterable

from ..errors import CheckpointWriteError
from ..io.files import atomic_write, fsync_dir, unlink_quietly

__all__ = ["EXCHANGE", "rename_exchange", "temp_sibling", "replace_path", "recover", "remove_stale_temps",
           "remove_dead_temps", "journal_path"]

#: Set to False to force the rename-aside fallback (tests do, to show its recovery works).
EXCHANGE = True
_AT_FDCWD = -100
_RENAME_NOREPLACE, _RENAME_EXCHANGE = 1, 2
_UNSUPPORTED = {errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP}


def _renameat2() -> Any:
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_RENAMEAT2 = _renameat2()


def _call_renameat2(a: str, b: str, flags: int) -> bool:
    """renameat2(a, b, flags); False where the call or the flag is unsupported, OSError on a real failure."""
    if _RENAMEAT2 is None:
        return False
    if _RENAMEAT2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), flags) == 0:
        return True
    err = ctypes.get_errno()
    if err in _UNSUPPORTED:
        return False
    raise OSError(err, os.strerror(err), b)


def rename_exchange(a: str, b: str) -> bool:
    """Atomically exchange the entries ``a`` and ``b``; False where exchanging is unavailable."""
    return EXCHANGE and _call_renameat2(a, b, _RENAME_EXCHANGE)


def _rename_noreplace(src: str, dst: str) -> None:
    if not _call_renameat2(src, dst, _RENAME_NOREPLACE):
        if os.path.lexists(dst):
            raise FileExistsError(errno.EEXIST, "destination appeared", dst)
        os.rename(src, dst)


def _host() -> str:
    """8 hex digits of this host's name: a temp sibling's pid means something only on the host that wrote it
    (a directory shared over the network is seen by processes of other hosts)."""
    return hashlib.sha1(socket.gethostname().encode()).hexdigest()[:8]


def temp_sibling(path: str, what: str = "tmp") -> str:
    """``.{name}.{what}-h{host}-{pid}-{hex}`` beside ``path``: the host and pid tell a stale one (its writer,
    a process of this host, is gone)."""
    parent, base = os.path.split(os.path.abspath(path))
    return os.path.join(parent, f".{base}.{what}-h{_host()}-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def journal_path(path: str) -> str:
    parent, base = os.path.split(os.path.abspath(path))
    return os.path.join(parent, f".{base}.replace-journal")


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        unlink_quietly(path)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


#: A temp sibling's name (:func:`temp_sibling`): base, kind, writer's host (absent in older names) and pid.
_TEMP = re.compile(r"^\.(?P<base>.+)\.(?P<what>tmp|old)-(?:h(?P<host>[0-9a-f]{8})-)?(?P<pid>\d+)-[0-9a-f]{8}(?:\..*)?$")


def _dead_writer(m: re.Match[str]) -> bool:
    """Whether the process that named a temp sibling is gone: of this host, not us, and not running."""
    pid = int(m.group("pid"))
    host = m.group("host")
    return (host is None or host == _host()) and pid != os.getpid() and not _alive(pid)


def remove_stale_temps(path: str) -> list[str]:
    """Remove temp siblings of ``path`` (see :func:`temp_sibling`) whose writing process is gone."""
    parent, base = os.path.split(os.path.abspath(path))
    removed = []
    for name in os.listdir(parent):
        m = _TEMP.match(name)
        if m and m.group("base") == base and _dead_writer(m):
            _remove(os.path.join(parent, name))
            removed.append(os.path.join(parent, name))
    return removed


def remove_dead_temps(directory: str) -> list[str]:
    """Remove the unfinished new versions (``.{name}.tmp-...``, :func:`temp_sibling`) that killed processes of
    this host left in ``directory``, whatever path they were for.

    Only ``tmp`` siblings of a path with no replacement journal: an ``old`` sibling holds a previous
    version, and a journal may still need its ``tmp`` (``recover`` of that path decides). Nothing
    whose name is not one :func:`temp_sibling` makes is touched.
    """
    names = os.listdir(directory)
    journaled = {n[1:-len(".replace-journal")] for n in names if n.startswith(".") and n.endswith(".replace-journal")}
    removed = []
    for name in names:
        m = _TEMP.match(name)
        if m and m.group("what") == "tmp" and m.group("base") not in journaled and _dead_writer(m):
            _remove(os.path.join(directory, name))
            removed.append(os.path.join(directory, name))
    return removed


# --------------------------------------------------------------------------- carrying foreign entries over
def _link_tree(src: str, dst: str, rel: str, copied: list[str]) -> None:
    """``dst`` becomes the same entry as ``src``: a hard link, a copy where linking is refused, or a tree of them."""
    if os.path.islink(src):
        os.symlink(os.readlink(src), dst)
    elif os.path.isdir(src):
        os.mkdir(dst)
        for name in sorted(os.listdir(src)):
            _link_tree(os.path.join(src, name), os.path.join(dst, name), f"{rel}/{name}", copied)
        shutil.copystat(src, dst, follow_symlinks=False)
    elif os.path.isfile(src):
        try:
            os.link(src, dst, follow_symlinks=False)
        except OSError:  # EPERM (protected_hardlinks), EMLINK, a file system without links
            shutil.copy2(src, dst)
            copied.append(rel)
    # FIFOs, sockets, devices are not carried: retiring the old tree moves them back


def _same(p: str, q: str, copied: bool) -> bool:
    a, b = os.lstat(p), os.lstat(q)
    if os.path.islink(p) and os.path.islink(q):
        return os.readlink(p) == os.readlink(q)
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino) or (copied and a.st_size == b.st_size)


def _retire_entry(p: str, q: str, rel: str, copied: set[str], kept: list[str]) -> None:
    """Drop ``p`` (old tree) if ``q`` (new tree) is the same entry; move it to ``q`` if there is none."""
    if not os.path.lexists(q):
        os.rename(p, q)  # created in the old tree while the new one was built: keep it
    elif os.path.isdir(p) and not os.path.islink(p) and os.path.isdir(q) and not os.path.islink(q):
        for name in os.listdir(p):
            _retire_entry(os.path.join(p, name), os.path.join(q, name), f"{rel}/{name}", copied, kept)
        try:
            os.rmdir(p)
        except OSError:
            pass
    elif _same(p, q, rel in copied):
        os.unlink(p)
    else:
        kept.append(p)


def _retire(old: str, dst: str, owned: Iterable[str], copied: Iterable[str]) -> list[str]:
    """Remove the old version moved aside to ``old``; returns entries that had to be left there."""
    if os.path.islink(old) or not os.path.isdir(old):
        unlink_quietly(old)
        return []
    owned, copies, kept = set(owned), set(copied), []
    target_is_dir = os.path.isdir(dst) and not os.path.islink(dst)
    for name in os.listdir(old):
        p = os.path.join(old, name)
        if name in owned:
            _remove(p)
        elif target_is_dir:
            _retire_entry(p, os.path.join(dst, name), name, copies, kept)
        else:
            kept.append(p)
    if not kept:
        try:
            os.rmdir(old)
            return []
        except OSError:
            pass
    # Something there is neither the old version's nor carried over: keep it under a name no cleanup removes.
    parent, base = os.path.split(os.path.abspath(dst))
    keep = os.path.join(parent, f".{base}.kept-{uuid.uuid4().hex[:8]}")
    os.rename(old, keep)
    return [keep]


# --------------------------------------------------------------------------- the swap
def _aside(dst: str, aside: str) -> None:
    os.rename(dst, aside)


def _rename_in(new: str, dst: str) -> None:
    os.rename(new, dst)


def replace_path(new: str, dst: str, *, owned: Iterable[str] = ()) -> list[str]:
    """Put the finished ``new`` (a durable file or directory beside ``dst``) at ``dst``.

    ``owned``: names in an old directory at ``dst`` that the new version replaces (with
    every name ``new`` holds); all other entries are carried into ``new`` first.

    Returns ``[]``, or the one hidden sibling (``.{name}.kept-*``) where entries of the old
    directory that could be neither removed nor carried over were kept.
    """
    parent = os.path.dirname(os.path.abspath(dst))
    if not os.path.lexists(dst):
        _rename_noreplace(new, dst)
        fsync_dir(parent)
        return []
    dst_is_dir = os.path.isdir(dst) and not os.path.islink(dst)
    if not dst_is_dir and not (os.path.isdir(new) and not os.path.islink(new)):
        os.replace(new, dst)  # file over file (or link): atomic already
        fsync_dir(parent)
        return []
    owned, copied = set(owned), []
    if dst_is_dir:
        new_names = set(os.listdir(new)) if os.path.isdir(new) else set()
        owned |= new_names & set(os.listdir(dst))
        foreign = sorted(set(os.listdir(dst)) - owned)
        if foreign and not os.path.isdir(new):
            raise CheckpointWriteError(f"a file cannot replace this directory without deleting {', '.join(foreign)}",
                                       path=dst)
        for name in foreign:
            _link_tree(os.path.join(dst, name), os.path.join(new, name), name, copied)
        if foreign:
            fsync_dir(new)
    st = os.lstat(new)
    aside = temp_sibling(dst, "old")
    doc = {"path": os.path.abspath(dst), "new": new, "aside": aside, "new_id": [st.st_dev, st.st_ino],
           "owned": sorted(owned), "copied": copied}
    atomic_write(journal_path(dst), (json.dumps(doc) + "\n").encode())
    if rename_exchange(new, dst):
        old = new
    else:
        _aside(dst, aside)
        _rename_in(new, dst)
        old = aside
    fsync_dir(parent)
    kept = _retire(old, dst, owned, copied)
    os.unlink(journal_path(dst))
    fsync_dir(parent)
    return kept


def recover(path: str) -> str | None:
    """Finish or undo a replacement of ``path`` that was interrupted; say what was done (None: nothing to do).

    The path missing and the old version aside: the old one is put back. The path holding
    the new version: the old one is retired. The path holding the old one: the unused new
    one is removed.
    """
    jp = journal_path(path)
    try:
        with open(jp, encoding="utf-8") as f:
            doc = json.load(f)
        new, aside, new_id = doc["new"], doc["aside"], tuple(doc["new_id"])
        owned, copied = doc["owned"], doc["copied"]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointWriteError(f"unreadable journal of an interrupted replacement ({e}); the previous "
                                   f"version may be in a hidden sibling: check it, then delete the journal",
                                   path=jp) from e
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.lexists(path):
        if os.path.lexists(aside):
            os.rename(aside, path)
            _remove(new)
            what = "restored the previous version"
        elif os.path.lexists(new):  # the path was removed by someone else before the swap: the new one is whole
            os.rename(new, path)
            what = "put the new version in place"
        else:
            what = "found neither version (removed by someone else)"
        kept = []
    else:
        st = os.lstat(path)
        if (st.st_dev, st.st_ino) == new_id:
            kept = _retire(aside if os.path.lexists(aside) else new, path, owned, copied)
            what = "finished the replacement"
        else:
            _remove(new)
            what, kept = "kept the previous version", []
    fsync_dir(parent)
    os.unlink(jp)
    fsync_dir(parent)
    return what + (f"; entries it could not place are kept in {kept[0]}" if kept else "")
