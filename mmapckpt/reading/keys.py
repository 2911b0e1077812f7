"""Choosing entries by name: the glob patterns of ``keys=`` and ``--keys``, and ``strip_prefix``.

One matcher for the whole package: ``mmapckpt.load(keys=...)``, ``open``/``load``/``load_into``
``strip_prefix=`` and ``convert --keys/--strip-prefix`` all select through this module.
Patterns are ``fnmatch`` globs matched against the whole stored name, case-sensitive;
``*`` also matches dots, so ``"model.*"`` selects ``model.layers.0.weight``. A name
without ``*``, ``?`` or ``[`` matches only itself, and a pattern always matches the name
spelled exactly as it (``"layers[0].w"`` selects that name, although as a glob it would not).
"""

from __future__ import annotations

import fnmatch
import re
from typing import Collection, Iterable, Sequence

from ..errors import CheckpointError

__all__ = ["check_patterns", "matches", "pick", "select_names", "strip_names"]


def check_patterns(patterns: Iterable[str]) -> list[str]:
    """``patterns`` as a list, checked: a collection of non-empty strings (a lone string is refused,
    since iterating it would match single characters).

    Raises:
        TypeError: ``patterns`` is a single string.
        ValueError: ``patterns`` is empty, or one of them is not a non-empty string.
    """
    if isinstance(patterns, str):
        raise TypeError(f"keys must be a list of glob patterns, not a single string: keys=[{patterns!r}]")
    pats = list(patterns)
    if not pats or not all(isinstance(p, str) and p for p in pats):
        raise ValueError(f"keys must be non-empty glob patterns, got {pats!r}")
    return pats


def matches(name: str, patterns: Collection[str]) -> bool:
    """Whether ``name`` matches any of the glob ``patterns`` (case-sensitive, the whole name), or is one of them."""
    return any(name == p or fnmatch.fnmatchcase(name, p) for p in patterns)


def pick(names: Sequence[str], patterns: Sequence[str]) -> tuple[list[str], list[str]]:
    """``(the names matching any of the patterns, in the names' order; the patterns matching no name)``, as
    :func:`matches` decides, in time linear in the names: a pattern that is a name is found by a set
    lookup (``keys=list(state_dict)`` picks thousands of names), the wildcard patterns run as one regex.
    """
    present = set(names)
    exact = present.intersection(patterns)
    globs = [p for p in dict.fromkeys(patterns) if any(c in p for c in "*?[")]
    rx = re.compile("|".join(f"(?:{fnmatch.translate(g)})" for g in globs)) if globs else None
    chosen = [n for n in names if n in exact or (rx is not None and rx.match(n))]
    # a wildcard pattern that matched a name matched a chosen one: only those are searched
    unmatched = [p for p in patterns if p not in exact and (p not in globs or not any(
        fnmatch.fnmatchcase(n, p) for n in chosen))]
    return chosen, unmatched


def strip_names(names: Sequence[str], strip_prefix: str, path: str, *,
                flags: tuple[str, str] = ("keys", "strip_prefix")) -> dict[str, str]:
    """``{new name: stored name}``: ``strip_prefix`` removed from the names that start with it, the
    others kept as they are (as ``torch.nn.modules.utils.consume_prefix_in_state_dict_if_present``).

    Args:
        names: the stored names, in order.
        strip_prefix: the prefix, e.g. ``"model."``.
        path: the checkpoint, for error messages.
        flags: how ``keys`` and ``strip_prefix`` are spelled in messages (see :func:`select_names`).

    Raises:
        ValueError: ``strip_prefix`` is not a non-empty string.
        CheckpointError: no name starts with it; stripping leaves a name empty or starting with
            ``.`` (a prefix missing its dot); two names become one.
    """
    flag = flags[1]
    if not isinstance(strip_prefix, str) or not strip_prefix:
        raise ValueError(f"strip_prefix must be a non-empty string, got {strip_prefix!r}")
    if not any(n.startswith(strip_prefix) for n in names):
        example = f" (e.g. {names[0]!r})" if names else ""
        raise CheckpointError(f"no selected entry starts with {flag} {strip_prefix!r}{example}; did you mean a "
                              "prefix ending in '.'?", path=path)
    out: dict[str, str] = {}
    for old in names:
        new = old.removeprefix(strip_prefix)
        if not new:
            raise CheckpointError(f"stripping {strip_prefix!r} leaves an empty name", path=path, entry=old)
        if new.startswith(".") and not old.startswith("."):  # "model" for "model.": an easy slip
            raise CheckpointError(f"stripping {strip_prefix!r} leaves {new!r}; did you mean {flag} "
                                  f"{strip_prefix + '.'!r}?", path=path, entry=old)
        if new in out:
            raise CheckpointError(f"stripping {strip_prefix!r} gives {out[new]!r} and {old!r} the same name "
                                  f"{new!r}; select only one of them with {flags[0]}", path=path, entry=old)
        out[new] = old
    return out


def select_names(names: Sequence[str], keys: Iterable[str] | None, strip_prefix: str | None, path: str, *,
                 flags: tuple[str, str] = ("keys", "strip_prefix")) -> dict[str, str]:
    """``{new name: stored name}``: the stored names matching any glob of ``keys`` (all without
    ``keys``), then ``strip_prefix`` removed from those that start with it, in the stored order.

    Args:
        names: the stored names, in order.
        keys: glob patterns (see the module docstring), or None for every name.
        strip_prefix: a prefix to remove (see :func:`strip_names`), or None.
        path: the checkpoint, for error messages.
        flags: how ``keys`` and ``strip_prefix`` are spelled in messages
            (``("--keys", "--strip-prefix")`` on the command line).

    Raises:
        TypeError, ValueError: ``keys`` is a single string or empty; ``strip_prefix`` is empty.
        CheckpointError: no name matches ``keys``, or :func:`strip_names` refuses the prefix.
    """
    chosen = list(names)
    if keys is not None:
        pats = check_patterns(keys)
        chosen, _ = pick(names, pats)
        if not chosen:
            shown = ", ".join(repr(n) for n in list(names)[:5]) + (", ..." if len(names) > 5 else "")
            raise CheckpointError(f"no entry matches {flags[0]} {' '.join(pats)} (patterns are globs on the stored "
                                  f"names, case-sensitive; the names are {shown})", path=path)
    if strip_prefix is None:
        return {n: n for n in chosen}
    return strip_names(chosen, strip_prefix, path, flags=flags)
