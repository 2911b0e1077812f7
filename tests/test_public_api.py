"""The public surface: __all__ is honest (the httpx pattern) and the error tree is the one errors.py draws."""

from __future__ import annotations

import builtins
import importlib
import inspect
import pickle
import pkgutil
import re
import types
from pathlib import Path

import pytest
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter

import mmapckpt
from mmapckpt import errors


def _public_members(mod: types.ModuleType) -> set[str]:
    return {name for name, value in vars(mod).items()
            if not name.startswith("_") and not isinstance(value, types.ModuleType)}


def test_all_equals_what_the_package_exports() -> None:
    assert len(mmapckpt.__all__) == len(set(mmapckpt.__all__)), "duplicates in __all__"
    for name in mmapckpt.__all__:  # the names are imported on first use (PEP 562): load them all
        getattr(mmapckpt, name)
    assert set(mmapckpt.__all__) == _public_members(mmapckpt) | {"__version__"}
    assert set(mmapckpt.__all__) <= set(dir(mmapckpt))


def test_type_checkers_see_the_same_names() -> None:
    """The ``TYPE_CHECKING`` block imports exactly the lazily exported names, from the modules that define them."""
    import ast

    tree = ast.parse(Path(mmapckpt.__file__).read_text())
    seen: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for imp in node.body:
                assert isinstance(imp, ast.ImportFrom)
                seen.update({a.name: "." * imp.level + (imp.module or "") for a in imp.names})
    assert seen == mmapckpt._WHERE
    assert list(mmapckpt.__all__) == [*mmapckpt._WHERE, "__version__"]


def test_importing_the_package_imports_no_torch() -> None:
    import subprocess
    import sys

    code = ("import sys, mmapckpt; v = mmapckpt.__version__; d = dir(mmapckpt); "
            "assert 'torch' not in sys.modules, 'torch imported'; "
            "from mmapckpt import CheckpointError; assert 'torch' not in sys.modules, 'torch imported by errors'; "
            "from mmapckpt import save; assert 'torch' in sys.modules")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_every_name_in_all_resolves() -> None:
    for name in mmapckpt.__all__:
        assert getattr(mmapckpt, name) is not None, name
    ns: dict[str, object] = {}
    exec("from mmapckpt import *", ns)
    assert set(ns) - {"__builtins__"} == set(mmapckpt.__all__)


def test_public_objects_are_documented() -> None:
    for name in mmapckpt.__all__:
        obj = getattr(mmapckpt, name)
        if callable(obj):
            assert (obj.__doc__ or "").strip(), f"{name} has no docstring"


def _submodules() -> list[str]:
    """Every module of the package and its wings (not the wings' ``__init__``, which exports nothing)."""
    return [m.name[len("mmapckpt."):] for m in pkgutil.walk_packages(mmapckpt.__path__, "mmapckpt.")
            if not m.ispkg and not m.name.endswith("__main__")]


@pytest.mark.parametrize("name", _submodules())
def test_submodule_all_resolves(name: str) -> None:
    mod = importlib.import_module(f"mmapckpt.{name}")
    names = getattr(mod, "__all__", None)
    assert isinstance(names, (list, tuple)), f"mmapckpt.{name} has no explicit __all__"
    assert len(names) == len(set(names))
    for n in names:
        assert hasattr(mod, n), f"mmapckpt.{name}.__all__ names {n!r}, which does not exist"


def test_py_typed_marker_ships() -> None:
    assert (Path(mmapckpt.__file__).parent / "py.typed").is_file()


def test_version_is_a_string() -> None:
    assert re.fullmatch(r"\d+\.\d+\.\d+.*", mmapckpt.__version__)


# --------------------------------------------------------------------------- storage interfaces
@pytest.mark.parametrize("cls, base", [(mmapckpt.MmapWriter, StorageWriter), (mmapckpt.MmapReader, StorageReader)])
def test_implements_the_whole_storage_interface(cls: type, base: type) -> None:
    assert issubclass(cls, base)
    assert not getattr(cls, "__abstractmethods__", None)
    for name, member in vars(base).items():
        if name.startswith("__") or not callable(getattr(base, name)) and not isinstance(member, property):
            continue
        assert name in vars(cls), f"{cls.__name__} inherits {name} from {base.__name__} instead of implementing it"


def test_constructor_options_are_keyword_only_with_documented_defaults() -> None:
    w = inspect.signature(mmapckpt.MmapWriter).parameters
    assert w["path"].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
    assert {n: w[n].default for n in ("thread_count", "sync_files", "alignment", "overwrite")} == {
        "thread_count": 1, "sync_files": True, "alignment": 4096, "overwrite": True}
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for n, p in w.items() if n != "path")
    r = inspect.signature(mmapckpt.MmapReader).parameters
    assert r["thread_count"].kind is inspect.Parameter.KEYWORD_ONLY and r["thread_count"].default == 1
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for n, p in r.items() if n != "path")


# --------------------------------------------------------------------------- the error tree
_TREE_LINE = re.compile(r"^(?P<indent>[ │]*)[├└]── (?P<name>\w+)(?:\s+\((?P<builtin>\w+)\))?")


def _drawn_tree() -> dict[str, tuple[str, str | None]]:
    """{class name: (parent name, builtin in parentheses or None)} from errors.py's docstring."""
    tree: dict[str, tuple[str, str | None]] = {}
    stack: list[tuple[int, str]] = [(-1, "Exception")]
    for line in (errors.__doc__ or "").splitlines():
        m = _TREE_LINE.match(line.strip("\n").removeprefix("    "))
        if not m:
            continue
        depth = len(m["indent"])
        while stack[-1][0] >= depth:
            stack.pop()
        tree[m["name"]] = (stack[-1][1], m["builtin"])
        stack.append((depth, m["name"]))
    return tree


def _error_classes() -> dict[str, type]:
    return {n: c for n, c in vars(errors).items() if isinstance(c, type) and issubclass(c, BaseException)
            and c.__module__ == errors.__name__}


def test_the_drawn_tree_is_parsed() -> None:
    tree = _drawn_tree()
    assert tree["CheckpointError"] == ("Exception", None)
    assert tree["FormatError"] == ("CheckpointError", "ValueError")
    assert tree["BadMagicError"] == ("FormatError", None)
    assert tree["CheckpointWriteError"] == ("CheckpointError", "OSError")


def test_error_tree_matches_the_drawing() -> None:
    tree, classes = _drawn_tree(), _error_classes()
    assert set(tree) == set(classes), "every error class is drawn, every drawn class exists"
    assert set(errors.__all__) == set(classes)
    for name, (parent, builtin) in tree.items():
        cls = classes[name]
        assert cls.__bases__[0] is classes.get(parent, Exception), f"{name} should subclass {parent} first"
        if builtin is not None:
            assert getattr(builtins, builtin) in cls.__bases__, f"{name} should also subclass {builtin}"


def test_every_error_is_a_checkpoint_error_and_a_builtin() -> None:
    builtin_excs = {v for v in vars(builtins).values() if isinstance(v, type) and issubclass(v, BaseException)}
    for name, cls in _error_classes().items():
        assert issubclass(cls, mmapckpt.CheckpointError), name
        assert getattr(mmapckpt, name) is cls, f"{name} is not exported from mmapckpt"
        if cls is not mmapckpt.CheckpointError:
            specific = {b for b in cls.__mro__ if b in builtin_excs} - {Exception, BaseException}
            assert specific, f"{name} subclasses no built-in exception users already catch"


@pytest.mark.parametrize("cls", list(_error_classes().values()), ids=list(_error_classes()))
def test_error_messages_name_file_and_entry_and_survive_pickling(cls: type) -> None:
    e = cls("what is wrong", path="/ckpt/__0_0.distcp", entry="w@[0]")
    assert str(e) == "/ckpt/__0_0.distcp: entry 'w@[0]': what is wrong"
    assert (e.path, e.entry, e.message) == ("/ckpt/__0_0.distcp", "w@[0]", "what is wrong")
    back = pickle.loads(pickle.dumps(e))  # DCP gathers rank failures by pickling them
    assert type(back) is cls and str(back) == str(e) and (back.path, back.entry) == (e.path, e.entry)
    assert str(cls("bare")) == "bare"
    assert str(cls("m", path="p")) == "p: m"


# --------------------------------------------------------------------------- the storage extension point
def test_the_storage_extension_point_is_public_and_documented() -> None:
    """``mmapckpt.storage`` names what a new medium implements and registers, each documented in docs/api.md."""
    import mmapckpt.storage as storage
    from mmapckpt.storage import base, location

    assert set(storage.__all__) == set(storage._WHERE)
    for name in storage.__all__:
        assert getattr(storage, name) is getattr(importlib.import_module(storage._WHERE[name], storage.__name__),
                                                 name)
    assert storage.CheckpointStorage is base.CheckpointStorage and storage.register_scheme is location.register_scheme
    text = (Path(__file__).resolve().parent.parent / "docs" / "api.md").read_text()
    for name in ("CheckpointStorage", "StoredFile", "FileOutput", "Lock", "register_scheme", "storage_for"):
        assert f"::: mmapckpt.storage.{name}" in text, name
    assert "tests/storage/test_storage_contract.py" in text
