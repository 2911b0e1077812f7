"""The API reference stays complete: docs/api.md names every public name, every public callable's
docstring documents every parameter, and the option tables match MmapWriter's and MmapReader's signatures.

These checks need no docs tooling (CI installs only ``.[test]``); with mkdocs and mkdocstrings installed
(the ``docs`` extra) the site is also built with ``--strict``, which fails on any docstring griffe cannot parse.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest

import mmapckpt

ROOT = Path(__file__).resolve().parent.parent
API_MD = ROOT / "docs" / "api.md"
#: Google-style sections whose entries name parameters or attributes, one name per entry.
_SECTIONS = {"Args", "Arguments", "Parameters", "Keyword Args", "Keyword Arguments", "Other Parameters", "Attributes"}
_ENTRY = re.compile(r"^(\*{0,2}[A-Za-z_]\w*)(?:\s*\([^)]*\))?:\s*(\S.*)?$")


def documented(doc: str | None) -> dict[str, str]:
    """{name: its description} from the Args/Attributes sections of a Google-style docstring."""
    out: dict[str, str] = {}
    lines = inspect.cleandoc(doc or "").splitlines()
    section, indent, last = False, None, None
    for line in lines:
        if not line.strip():
            continue
        depth = len(line) - len(line.lstrip())
        if depth == 0:
            section, indent = line.strip().rstrip(":") in _SECTIONS and line.rstrip().endswith(":"), None
            continue
        if not section:
            continue
        if indent is None:
            indent = depth
        if depth == indent:
            m = _ENTRY.match(line.strip())
            last = m.group(1).lstrip("*") if m else None
            if last is not None:
                out[last] = (m.group(2) or "").strip()
        elif last is not None:
            out[last] += " " + line.strip()
    return out


def _own_parameters(obj: object) -> list[inspect.Parameter]:
    """The parameters a public callable's own docstring must document (a class: its own ``__init__``;
    a dataclass or NamedTuple: its fields, as Attributes)."""
    if inspect.isclass(obj):
        fields = ([f.name for f in dataclasses.fields(obj)] if dataclasses.is_dataclass(obj)
                  else list(getattr(obj, "_fields", None) or ()))  # a NamedTuple
        if fields:
            return [inspect.Parameter(f, inspect.Parameter.KEYWORD_ONLY) for f in fields]
        if "__init__" not in vars(obj):
            return []  # inherited from a documented base (an error subclass, a DCP planner)
    params = list(inspect.signature(obj).parameters.values())
    return [p for p in params if p.name not in ("self", "cls")]


def _public_callables() -> list[tuple[str, object]]:
    return [(n, getattr(mmapckpt, n)) for n in mmapckpt.__all__ if callable(getattr(mmapckpt, n))]


def test_api_md_lists_every_public_name() -> None:
    text = API_MD.read_text()
    directives = set(re.findall(r"^::: mmapckpt\.(\w+)\s*$", text, re.MULTILINE))
    missing = [n for n in mmapckpt.__all__ if n not in directives and f"`mmapckpt.{n}`" not in text]
    assert not missing, f"docs/api.md does not document {missing}: add a '::: mmapckpt.NAME' line"
    unknown = directives - set(mmapckpt.__all__)
    assert not unknown, f"docs/api.md documents names that are not public: {sorted(unknown)}"


@pytest.mark.parametrize("name, obj", _public_callables(), ids=[n for n, _ in _public_callables()])
def test_every_parameter_is_documented(name: str, obj: object) -> None:
    doc = documented(obj.__doc__)
    missing = [p.name for p in _own_parameters(obj) if not doc.get(p.name)]
    assert not missing, (f"mmapckpt.{name}: the docstring's Args (or, for a dataclass, Attributes) section does not "
                         f"document {missing}; one 'name: what it does' entry per parameter")
    grouped = [k for k in documented(obj.__doc__) if "," in k]
    assert not grouped


def _option_table(cls: type) -> dict[str, tuple[str, str]]:
    """{option: (default as written, when to change it)} from the table under ``### `Cls(path, **options)` ``."""
    text = API_MD.read_text()
    m = re.search(rf"^### `{cls.__name__}\(path, \*\*options\)`\n(.*?)(?=^#)", text, re.MULTILINE | re.DOTALL)
    assert m, f"docs/api.md has no options table for {cls.__name__}"
    rows = re.findall(r"^\| `(\w+)` \| `([^`]*)` \| (.*) \|$", m.group(1), re.MULTILINE)
    return {name: (default, why) for name, default, why in rows}


@pytest.mark.parametrize("cls", [mmapckpt.MmapWriter, mmapckpt.MmapReader], ids=lambda c: c.__name__)
def test_option_tables_match_the_signatures(cls: type) -> None:
    table = _option_table(cls)
    options = {p.name: p.default for p in inspect.signature(cls).parameters.values()
               if p.kind is inspect.Parameter.KEYWORD_ONLY}
    assert set(table) == set(options), (f"docs/api.md's {cls.__name__} table: missing {sorted(set(options) - set(table))}, "
                                        f"not options {sorted(set(table) - set(options))}")
    for name, default in options.items():
        shown, why = table[name]
        assert shown == repr(default), f"{cls.__name__}({name}=...): the table says {shown}, the signature {default!r}"
        assert len(why.split()) >= 6, f"{cls.__name__}({name}=...): say when to change it"


def test_the_checks_catch_an_undocumented_option() -> None:
    """The parser sees a dropped entry, a grouped entry and a missing section (the checks above rely on it)."""
    doc = """Summary.

    Args:
        path: the directory.
        thread_count: files in parallel,
            continued here.
        staging_bytes, staging_buffers: grouped.

    Returns:
        nothing: not a parameter.
    """
    got = documented(doc)
    assert got["thread_count"] == "files in parallel, continued here."
    assert "path" in got and "nothing" not in got and "staging_bytes" not in got
    assert documented("No sections.") == {}


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("mkdocstrings") is None,
                    reason="the docs extra (mkdocs, mkdocstrings-python) is not installed")
def test_the_site_builds_strictly(tmp_path) -> None:
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    page = (tmp_path / "site" / "api" / "index.html").read_text()
    for name in mmapckpt.__all__:
        if name != "__version__":
            assert f'id="mmapckpt.{name}"' in page, name
