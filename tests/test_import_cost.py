"""The single-process load path needs no torch.distributed beyond what ``import torch`` loads, and none of
mmapckpt's own modules that only other loads use.

``open``, ``load``, ``load_into`` and ``load_model`` of a local mmapckpt checkpoint, a
safetensors file, a Hugging Face directory (sharded, with its index; and one of
``pytorch_model.bin``) and a torch.save file read the format's own index: DCP's ``Metadata`` classes (``torch.distributed.checkpoint``) and DTensor
(``torch.distributed.tensor``) are for ``dcp.load``/``dcp.save`` only. ``import torch``
itself loads a few ``torch.distributed`` base modules (``distributed_c10d`` and such):
whatever it loads is taken as given, and no further ``torch.distributed`` module may appear.
(A stock DCP checkpoint does import ``torch.distributed.checkpoint``: its ``.metadata`` is a
pickle of DCP's classes.) Nor may the accelerator staging pipeline (io/staging.py, host registration,
the ring; about a tenth of ``import mmapckpt`` + ``load_into`` in a new process) come in for CPU
targets, nor the metadata decoders of version 1 and of stock DCP for a checkpoint written today, nor the write
side of the local storage (the save lock, the swap's journal), nor another format's backend: a load of an mmapckpt
checkpoint imports no safetensors or torch.save reader (their imports are about a twentieth of the load path's).
Each step runs in one fresh process, in order, and the modules it brought in are reported
per step, so a failure names the call and the format that imported them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

import mmapckpt

_CHILD = r"""
import json, sys, torch
before = set(sys.modules)
import mmapckpt

paths = json.loads(sys.argv[1])
report = []

UNNEEDED = ("mmapckpt.io.staging", "mmapckpt.io.host_register", "mmapckpt.io.host_drivers", "mmapckpt.io.ring",
            "mmapckpt.format.metadata.v1", "mmapckpt.format.metadata.stock",
            "mmapckpt.storage.replace", "mmapckpt.storage.lock")  # the write side: a save's lock, a swap's journal
SAFETENSORS = ("mmapckpt.format.safetensors", "mmapckpt.reading.safetensors_files", "mmapckpt.reading.dcp_safetensors")
TORCH_SAVE = ("mmapckpt.reading.torchfile", "mmapckpt.format.stock")
# the kinds load in this order: the backends of formats not loaded yet must not be imported
NOT_YET = {"mmapckpt": SAFETENSORS + TORCH_SAVE, "safetensors": TORCH_SAVE[:1], "hf": TORCH_SAVE[:1]}

def step(what, fn, kind):
    fn()
    unneeded = UNNEEDED + NOT_YET.get(kind, ())
    new = sorted(m for m in set(sys.modules) - before if m.startswith("torch.distributed") or m in unneeded)
    report.append([what, new])

def targets():
    return {"weight": torch.empty(3, 4), "bias": torch.empty(3)}

def opened(path):
    with mmapckpt.open(path) as f:
        f.keys(), f.get_tensor("weight"), f.get_slice("weight")[1:2], f.info("bias"), f.metadata()

def model(path):
    with torch.device("meta"):
        m = torch.nn.Linear(4, 3)
    mmapckpt.load_model(m, path)

for kind, path in paths.items():
    step(f"load_into {kind}", lambda: mmapckpt.load_into(targets(), path), kind)
    step(f"load {kind}", lambda: mmapckpt.load(path), kind)
    step(f"open {kind}", lambda: opened(path), kind)
    step(f"load_model {kind}", lambda: model(path), kind)
print(json.dumps(report))
"""


def _checkpoints(tmp_path: Path) -> dict[str, str]:
    torch.manual_seed(0)
    sd = torch.nn.Linear(4, 3).state_dict()
    mmapckpt.save(sd, tmp_path / "mm")
    save_file(sd, tmp_path / "file.safetensors")
    hf = tmp_path / "hf"
    hf.mkdir()
    save_file({"weight": sd["weight"]}, hf / "model-00001-of-00002.safetensors")
    save_file({"bias": sd["bias"]}, hf / "model-00002-of-00002.safetensors")
    index = {"metadata": {}, "weight_map": {"weight": "model-00001-of-00002.safetensors",
                                            "bias": "model-00002-of-00002.safetensors"}}
    (hf / "model.safetensors.index.json").write_text(json.dumps(index))
    (hf / "config.json").write_text("{}")
    hf_bin = tmp_path / "hf_bin"
    hf_bin.mkdir()
    torch.save(sd, hf_bin / "pytorch_model.bin")
    (hf_bin / "config.json").write_text("{}")
    torch.save(sd, tmp_path / "file.pt")
    return {"mmapckpt": str(tmp_path / "mm"), "safetensors": str(tmp_path / "file.safetensors"), "hf": str(hf),
            "hf_bin": str(hf_bin), "torch_save": str(tmp_path / "file.pt")}


def test_single_process_loads_import_no_torch_distributed_beyond_torch_nor_staging(tmp_path: Path) -> None:
    paths = _checkpoints(tmp_path)
    # subprocess.run kills the child on the timeout (and waits for it) before raising
    p = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(paths)], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr
    report = json.loads(p.stdout.strip().splitlines()[-1])
    assert [what for what, _ in report] == [f"{op} {kind}" for kind in paths
                                            for op in ("load_into", "load", "open", "load_model")]
    for what, new in report:
        assert new == [], f"{what} imported {len(new)} modules it does not use: {new[:8]}"


_CLI_CHILD = r"""
import json, sys
from mmapckpt.tools.cli import main

report = {}
for argv in json.loads(sys.argv[1]):
    code = main(argv)
    report[" ".join(argv)] = [code, sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))]
print(json.dumps(report))
"""


def test_inspect_and_verify_of_mmapckpt_and_safetensors_import_no_torch(tmp_path: Path) -> None:
    """``mmapckpt inspect`` and ``mmapckpt verify`` of an mmapckpt checkpoint, a safetensors file and a Hugging Face
    directory run in a process that never imports torch (the index holds dtype names); a stock DCP checkpoint
    (a pickle of DCP's classes) then does."""
    paths = _checkpoints(tmp_path)
    argvs = [[cmd, paths[k], *extra] for k in ("mmapckpt", "safetensors", "hf") for cmd in ("inspect", "verify")
             for extra in ([], ["--json"])]
    p = subprocess.run([sys.executable, "-c", _CLI_CHILD, json.dumps(argvs)], capture_output=True, text=True,
                       timeout=300, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    report = json.loads(p.stdout.strip().splitlines()[-1])
    assert len(report) == len(argvs)
    for what, (code, torch_modules) in report.items():
        assert code == 0, what
        assert torch_modules == [], f"{what} imported torch: {torch_modules[:5]}"


_LAZY_CHILD = r"""
import json, sys, torch
import mmapckpt

path, steps, prefixed = sys.argv[1], sys.argv[2], sys.argv[3]
report = []

def step(what, fn, absent, present=()):
    fn()
    report.append([what, sorted(m for m in absent if m in sys.modules),
                   sorted(m for m in present if m not in sys.modules)])

def opened():
    with mmapckpt.open(path) as f:
        f.keys(), f.get_tensor("weight"), f.get_slice("weight")[1:2], f.info("bias"), f.metadata()

def model():
    with torch.device("meta"):
        m = torch.nn.Linear(4, 3)
    mmapckpt.load_model(m, path)

# views need no reads into targets (reading/fill.py, its moves and reader threads); no load needs the
# explanation of a missing shard (storage/commits.py) unless one is missing
VIEWS = ("mmapckpt.reading.fill", "mmapckpt.reading.moves", "mmapckpt.io.direct_reads", "mmapckpt.io.reads",
         "mmapckpt.storage.commits")
# a cached file is copied from the page cache: no choice of a way to read a cold file, nor the ways
COLD = ("mmapckpt.io.cold_plan", "mmapckpt.io.cold_reads", "mmapckpt.io.read_choice", "mmapckpt.io.odirect",
        "mmapckpt.storage.commits")
# load_into of tensors stored whole into CPU targets of their dtypes uses none of: the assembly of chunks and reads of
# selections (reading/regions.py), the reads of files without a mapping (reading/fetches.py), the accelerator's
# stager, the checks of casts, the name filters, the read ahead of views, tied weights, decoded entries' transforms
INTO = COLD + ("mmapckpt.reading.regions", "mmapckpt.reading.fetches", "mmapckpt.reading.stager",
               "mmapckpt.format.casts", "mmapckpt.reading.keys", "mmapckpt.reading.read_ahead",
               "mmapckpt.format.aliases", "mmapckpt.format.transforms")
if steps == "views":
    step("open", opened, VIEWS)
    step("load", lambda: mmapckpt.load(path), VIEWS)
    step("load_model", model, VIEWS)
else:  # each is imported by the call that uses it (a cast into float64, a strip_prefix)
    step("load_into", lambda: mmapckpt.load_into({"weight": torch.empty(3, 4), "bias": torch.empty(3)}, path), INTO)
    step("load_into, a cast", lambda: mmapckpt.load_into({"weight": torch.empty(3, 4, dtype=torch.float64)}, path,
                                                         strict=False), COLD, ("mmapckpt.format.casts",))
    step("load_into, strip_prefix", lambda: mmapckpt.load_into({"weight": torch.empty(3, 4)}, prefixed,
                                                               strip_prefix="model."), COLD, ("mmapckpt.reading.keys",))
print(json.dumps(report))
"""


def test_loads_of_a_cached_checkpoint_import_only_what_they_use(tmp_path: Path) -> None:
    """In a new process: ``open``, ``load`` and ``load_model`` of an mmapckpt checkpoint (views over its mappings)
    import none of the machinery that reads into targets, and ``load_into`` of one whose pages are cached (just
    written) none of the cold-file reading (the way's choice, O_DIRECT, the streams), nor, into CPU targets of the
    stored dtypes, any of the modules only other loads use (chunk assembly, objects' reads, the accelerator's
    stager, casts, name filters, read ahead, tied weights, transforms); none imports the missing-shard explanation.
    Each is imported when used (tests/io: cold loads; here a cast and a strip_prefix)."""
    torch.manual_seed(0)
    path = tmp_path / "mm"
    sd = torch.nn.Linear(4, 3).state_dict()
    mmapckpt.save(sd, path)
    mmapckpt.save({f"model.{k}": v for k, v in sd.items()}, tmp_path / "prefixed")
    report = []
    for steps in ("views", "into"):  # each in its own new process (views import what load_into must not)
        p = subprocess.run([sys.executable, "-c", _LAZY_CHILD, str(path), steps, str(tmp_path / "prefixed")], capture_output=True, text=True,
                           timeout=300)
        assert p.returncode == 0, p.stderr
        report += json.loads(p.stdout.strip().splitlines()[-1])
    assert [what for what, _, _ in report] == ["open", "load", "load_model", "load_into", "load_into, a cast",
                                                 "load_into, strip_prefix"]
    for what, imported, not_imported in report:
        assert imported == [], f"{what} of a cached mmapckpt checkpoint imported {imported}"
        assert not_imported == [], f"{what} did not import {not_imported}, which it uses"


_SAVE_CHILD = r"""
import json, sys
import torch
import mmapckpt

sd = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "tied": None, "b": torch.ones(5, dtype=torch.bfloat16)}
sd["tied"] = sd["w"]
saved = mmapckpt.save(sd, sys.argv[1], metadata={"k": "v"}, thread_count=2)
print(json.dumps([saved.write_path, sorted(m for m in sys.modules if m.startswith("torch.distributed"))]))
"""


def test_save_imports_no_torch_distributed(tmp_path: Path) -> None:
    """``mmapckpt.save`` of a flat dict writes DCP's checkpoint without DCP (saving.py): ``torch.distributed``'s
    package (which a plain ``import torch`` loads) and nothing under it; the checkpoint then loads with DCP."""
    before = subprocess.run([sys.executable, "-c", "import json, sys, torch; print(json.dumps(sorted("
                             "m for m in sys.modules if m.startswith('torch.distributed'))))"],
                            capture_output=True, text=True, timeout=300)
    assert before.returncode == 0, before.stderr
    p = subprocess.run([sys.executable, "-c", _SAVE_CHILD, str(tmp_path / "ck")], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr
    how, loaded = json.loads(p.stdout.strip().splitlines()[-1])
    assert how in ("direct", "buffered")
    assert set(loaded) <= set(json.loads(before.stdout)), sorted(set(loaded) - set(json.loads(before.stdout)))
    import torch.distributed.checkpoint as dcp

    out = {"w": torch.zeros(3, 4), "tied": torch.zeros(3, 4), "b": torch.zeros(5, dtype=torch.bfloat16)}
    dcp.load(out, storage_reader=mmapckpt.MmapReader(tmp_path / "ck"), no_dist=True)
    assert torch.equal(out["w"], torch.arange(12, dtype=torch.float32).reshape(3, 4))
    assert torch.equal(out["tied"], out["w"]) and torch.equal(out["b"], torch.ones(5, dtype=torch.bfloat16))


_BUILT_CHILD = r"""
import json, re, sys, torch
import mmapckpt
from mmapckpt.records import Record

path = sys.argv[1]
mmapckpt.load_into({"weight": torch.empty(3, 4), "bias": torch.empty(3)}, path)
mmapckpt.load(path)
with mmapckpt.open(path) as f:
    f.keys(), f.get_tensor("weight"), f.info("bias")
named, patterns = [], []
for name, module in sorted(sys.modules.items()):
    if not name.startswith("mmapckpt"):
        continue
    for attr, value in vars(module).items():
        if isinstance(value, re.Pattern):
            patterns.append(f"{name}.{attr}")
        elif isinstance(value, type) and value.__module__ == name and issubclass(value, tuple) \
                and hasattr(value, "_fields") and not issubclass(value, Record):
            named.append(f"{name}.{attr}")
print(json.dumps([named, patterns]))
"""


def test_the_local_load_path_compiles_no_code_at_import(tmp_path: Path) -> None:
    """The modules a new process imports to open and load a local mmapckpt checkpoint build their named tuples as
    ``records.Record``s, not ``typing.NamedTuple``s (which compile each class's ``__new__`` and each field's annotation
    string: about 0.13 ms a class, against 0.01), and compile no regular expression at import (``re`` compiles a
    pattern on its first use: a load that does not use one does not pay for it)."""
    torch.manual_seed(0)
    mmapckpt.save(torch.nn.Linear(4, 3).state_dict(), tmp_path / "mm")
    p = subprocess.run([sys.executable, "-c", _BUILT_CHILD, str(tmp_path / "mm")], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr
    named, patterns = json.loads(p.stdout.strip().splitlines()[-1])
    assert named == [], f"named tuples made by typing.NamedTuple on the local load path: {named}"
    assert patterns == [], f"regular expressions compiled at import on the local load path: {patterns}"


def test_a_local_load_reads_its_commit_with_one_open(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``open_dcp`` finds and reads the committed ``.metadata`` with one open (``read_commit``): with the format's
    recognition (its first 8 bytes), a local load opens it twice; each open resolves the path and checks the
    descriptor (4 ``realpath``s, a ``readlink``)."""
    from mmapckpt.storage.local import LocalStorage

    mmapckpt.save({"w": torch.arange(6.0)}, tmp_path / "mm")
    opened: list[str] = []
    real = LocalStorage.open_file

    def counted(self: LocalStorage, name: str) -> Any:
        opened.append(name)
        return real(self, name)

    monkeypatch.setattr(LocalStorage, "open_file", counted)
    assert torch.equal(mmapckpt.load(tmp_path / "mm")["w"], torch.arange(6.0))
    assert opened.count(".metadata") == 2, opened
