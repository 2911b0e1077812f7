"""Counted nouns for the command line's reports: ``count(1, "shard file")`` is "1 shard file"."""

from __future__ import annotations

__all__ = ["count", "plural"]


def plural(noun: str) -> str:
    """The plural of ``noun``'s last word: "shard file" -> "shard files", "entry" -> "entries"."""
    if noun.endswith("y") and noun[-2:-1] not in ("", *"aeiou"):
        return noun[:-1] + "ies"
    if noun.endswith(("s", "x", "ch", "sh")):
        return noun + "es"
    return noun + "s"


def count(n: int, noun: str, many: str | None = None) -> str:
    """``n`` and ``noun``, plural unless ``n`` is 1 (``many``: an irregular plural)."""
    return f"{n} {noun if n == 1 else (many or plural(noun))}"
