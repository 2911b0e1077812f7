"""The package's architecture as a contract: wings import only the wings below them.

The import-linter contracts live in pyproject.toml and are drawn in docs/design.md.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import mmapckpt

ROOT = Path(__file__).resolve().parents[1]
PKG = Path(mmapckpt.__file__).parent
LINT = shutil.which("lint-imports") or os.path.join(os.path.dirname(sys.executable), "lint-imports")

#: docs/design.md: modules are split where their ideas split; a module near 500 lines or a class near 200 is a
#: question to ask (does it hold two ideas?), and past these it is a failure.
MAX_MODULE_LINES = 500
MAX_CLASS_LINES = 200


def _lint(cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([LINT, "--config", str(cwd / "pyproject.toml"), "--no-cache"], cwd=cwd,
                          capture_output=True, text=True, timeout=300, env=env)


def test_import_contracts_are_kept() -> None:
    p = _lint(ROOT)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "0 broken" in p.stdout


@pytest.mark.parametrize("module, line, contract", [
    ("format/entries.py", "from ..dcp import reader as _upward", "Wings import only the wings below them"),
    ("conversion/sources.py", "from .sinks import raw_bytes as _sideways", "The conversion wing"),
    ("bench/demo.py", "from ..conversion import driver as _sideways", "do not know each other"),
    ("format/dtypes.py", "from ..io import files as _opens_files", "The format defines bytes"),
    ("storage/base.py", "from ..reading import shard as _upward", "Wings import only the wings below them"),
    ("bench/synthetic.py", "from . import runner as _around", "No import circle"),
    ("format/metadata/framing.py", "from . import codec as _around", "No import circle"),
])
def test_an_import_against_the_layering_breaks_a_contract(tmp_path: Path, module: str, line: str,
                                                          contract: str) -> None:
    """The contracts would catch a real violation: a copy of the package with one bad import fails."""
    shutil.copytree(PKG, tmp_path / "mmapckpt", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    with open(tmp_path / "mmapckpt" / module, "a") as f:
        f.write(f"\n{line}  # noqa\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    p = _lint(tmp_path, env)
    assert p.returncode != 0, p.stdout
    assert contract in p.stdout.split("Broken contracts")[-1]
    # and the copy it checked was this one, not the installed package
    where = "import importlib.util; print(importlib.util.find_spec('mmapckpt').origin)"
    assert str(tmp_path) in subprocess.run([sys.executable, "-c", where], env=env, cwd=tmp_path,
                                           capture_output=True, text=True).stdout


def test_import_mmapckpt_does_not_import_the_benchmark() -> None:
    code = "import sys, mmapckpt; print(sorted(m for m in sys.modules if m.startswith('mmapckpt.bench')))"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "[]"


def _imports_of_the_face(src: str, rel: Path) -> list[str]:
    """The imports in ``src`` (module ``rel`` of the package) that name the package root ``mmapckpt`` itself (its
    face), not one of its modules."""
    tree = ast.parse(src)
    package = ".".join(("mmapckpt", *rel.parent.parts))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name == "mmapckpt"]
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            target = ".".join(filter(None, (base, node.module))) if node.level else (node.module or "")
            if target == "mmapckpt":  # `from .. import X` at the root: X must be a module, never a face name
                found += [f"from mmapckpt import {a.name}" for a in node.names
                          if not (PKG / a.name).is_dir() and not (PKG / f"{a.name}.py").is_file()]
    return found


def test_nothing_in_the_package_imports_its_face() -> None:
    """The face (``mmapckpt/__init__.py``) is for users: a module that imports it depends on every wing at once
    (the command line included: tools/cli.py imports the wings it runs)."""
    offenders = {str(p.relative_to(PKG)): names for p in _modules() if p != PKG / "__init__.py"
                 for names in [_imports_of_the_face(p.read_text(), p.relative_to(PKG))] if names}
    assert not offenders, offenders


@pytest.mark.parametrize("line, where, face", [
    ("from .. import __version__", "tools/cli.py", True),
    ("from .. import load", "tools/cli.py", True),
    ("from ... import open", "storage/s3/reads.py", True),
    ("import mmapckpt", "io/files.py", True),
    ("from mmapckpt import save", "bench/demo.py", True),
    ("from .. import errors", "tools/cli.py", False),
    ("from ..io import files", "tools/cli.py", False),
    ("from . import wording", "tools/cli.py", False),
    ("from .. import layout", "format/metadata/v1.py", False),
])
def test_the_face_check_tells_the_face_from_a_module(line: str, where: str, face: bool) -> None:
    assert bool(_imports_of_the_face(line + "\n", Path(where))) is face


def _modules() -> list[Path]:
    return sorted(PKG.rglob("*.py"))


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PKG)))
def test_modules_and_classes_stay_small(path: Path) -> None:
    src = path.read_text()
    assert src.count("\n") <= MAX_MODULE_LINES, f"{path.name} has {src.count(chr(10))} lines"
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.ClassDef):
            n = node.end_lineno - node.lineno + 1  # type: ignore[operator]
            assert n <= MAX_CLASS_LINES, f"{path.name}: class {node.name} has {n} lines"
