"""What ``mmapckpt verify`` reports: problems (defects), warnings (unreferenced files) and notes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..conversion.progress import human_bytes
from ..errors import CheckpointError

__all__ = ["Problem", "FileWarning", "VerifyReport"]


@dataclass(frozen=True)
class Problem:
    """One defect: the file and entry concerned and what is wrong.

    Attributes:
        error: the name of the CheckpointError subclass that reading the checkpoint raises for it (``open``,
            ``load``, ``dcp.load`` and ``convert`` raise the same class for the same damage).
    """

    path: str
    entry: str | None
    message: str
    error: str = "CheckpointError"

    @classmethod
    def of(cls, e: CheckpointError, path: str) -> "Problem":
        return cls(e.path or path, e.entry, e.message, type(e).__name__)

    def __str__(self) -> str:
        where = self.path + (f": entry {self.entry!r}" if self.entry else "")
        return f"{where}: {self.message}"


@dataclass(frozen=True)
class FileWarning:
    """A file in the checkpoint directory that no metadata references (not a defect)."""

    path: str
    size: int
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message} ({human_bytes(self.size)})"


@dataclass
class VerifyReport:
    """The outcome of :func:`verify_checkpoint`: what was checked, problems, warnings and notes (not defects).

    Attributes:
        path: the path verified.
        checked: one line per check that passed.
        problems: every defect found, each naming its file and entry; ``ok`` is True without any.
        notes: facts worth knowing that are not defects (e.g. what a format cannot check).
        warnings: files in the directory that the checkpoint does not reference, with their sizes.
        bytes_checked: bytes whose checksums were checked.
    """

    path: str
    checked: list[str] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    warnings: list[FileWarning] = field(default_factory=list)
    bytes_checked: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "ok": self.ok, "checked": self.checked, "notes": self.notes,
                "bytes_checked": self.bytes_checked,
                "warnings": [{"path": w.path, "bytes": w.size, "message": w.message} for w in self.warnings],
                "problems": [{"path": p.path, "entry": p.entry, "message": p.message, "error": p.error}
                             for p in self.problems]}
