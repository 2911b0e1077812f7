"""Every write failure of ``convert`` is a CheckpointWriteError naming the destination (and the entry where the
sink knows it), and leaves the destination as it was and nothing beside it.

Two real failures, through every sink (mmapckpt, stock DCP, a safetensors file, Hugging Face shards,
torch.save: its scratch file and its final ``torch.save``):

* a file-size limit (RLIMIT_FSIZE) in a child process: writes past it fail with EFBIG;
* a full disk: a small tmpfs, mounted for the test (root and mount rights; skipped elsewhere).

Before this, ``--to dcp`` (and ``--to torch`` once its scratch file fitted) raised torch's own
RuntimeError ("unexpected pos ...", the errno lost). Also: a dtype the target format cannot hold.
"""

from __future__ import annotations

import errno
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import textwrap

import pytest
import torch
from helpers import mounted, tensor_bytes

import mmapckpt
from mmapckpt import CheckpointError, CheckpointWriteError, convert

MiB = 1 << 20

_CHILD = textwrap.dedent("""
    import hashlib, json, os, resource, sys, warnings
    import mmapckpt
    warnings.simplefilter("ignore")

    def digest(p):
        if not os.path.lexists(p):
            return None
        if os.path.isdir(p):
            return {n: digest(os.path.join(p, n)) for n in sorted(os.listdir(p))}
        return hashlib.sha256(open(p, "rb").read()).hexdigest()

    out = []
    for case in json.loads(sys.argv[1]):
        before = digest(case["dst"])
        resource.setrlimit(resource.RLIMIT_FSIZE, (case["limit"], resource.RLIM_INFINITY))
        try:
            mmapckpt.convert(case["src"], case["dst"], to=case["to"], overwrite=True, **case["opts"])
            got = {"raised": None}
        except BaseException as e:
            got = {"raised": [c.__name__ for c in type(e).__mro__], "message": str(e),
                   "entry": getattr(e, "entry", None)}
        resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        parent = os.path.dirname(case["dst"])
        got.update(unchanged=digest(case["dst"]) == before, existed=before is not None,
                   siblings=sorted(n for n in os.listdir(parent) if n.startswith(".")))
        out.append(got)
    print(json.dumps(out))
""")


def _state(seed: int, n: int, numel: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layers.{i}.w": torch.randn(numel, generator=g) for i in range(n)}


#: (name, to, options, files the failure may name) for every sink
SINKS = [("mmapckpt", "mmapckpt", {}), ("dcp", "dcp", {}), ("safetensors", "safetensors", {}),
         ("hf", "safetensors", {"max_shard_size": "3MB"}), ("torch", "torch", {})]


def _dst(root, name: str) -> str:
    return os.path.join(str(root), {"safetensors": "m.safetensors", "torch": "m.pt"}.get(name, name))


def test_every_sink_turns_a_file_size_limit_into_a_checkpoint_write_error(tmp_path):
    src = str(tmp_path / "src")
    mmapckpt.save(_state(1, 4, 300_000), src)  # four 1.2 MB tensors (sizes at which torch.save met the limit
    # with bytes still in its buffer: before, --to dcp raised torch's RuntimeError "unexpected pos 704 vs 598")
    one = str(tmp_path / "one")
    mmapckpt.save(_state(2, 1, MiB // 4), one)  # one 1 MiB tensor: torch's scratch file fits the limit below
    cases, names = [], []
    for overwrite in (False, True):
        where = tmp_path / ("over" if overwrite else "fresh")
        where.mkdir()
        for name, to, opts in SINKS:
            dst = _dst(where, name)
            if overwrite:
                convert(one, dst, to=to, **opts)  # an old checkpoint that must survive
            cases.append({"src": src, "dst": dst, "to": to, "opts": opts, "limit": MiB})
            names.append(f"{name}{' over an old one' if overwrite else ''}")
    # torch.save itself failing: the scratch file (1 MiB exactly) fits, the torch.save archive does not
    cases.append({"src": one, "dst": str(tmp_path / "fresh" / "final.pt"), "to": "torch", "opts": {},
                  "limit": MiB + 100})
    names.append("torch, its final torch.save")
    r = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(cases)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    results = json.loads(r.stdout.splitlines()[-1])
    for name, case, got in zip(names, cases, results):
        assert got["raised"] and "CheckpointWriteError" in got["raised"], f"{name}: {got}"
        assert os.strerror(errno.EFBIG) in got["message"] and case["dst"] in got["message"], f"{name}: {got}"
        assert ("was left as it was" if got["existed"] else "was not created") in got["message"], f"{name}: {got}"
        assert got["unchanged"] and got["siblings"] == [], f"{name}: {got}"
        assert "writing failed" not in got["message"] and "shard failed" not in got["message"], \
            f"{name}: the sink's words stay under 'conversion failed writing FILE': {got}"
        if name.startswith("dcp"):  # the stock writer's items are written one torch.save at a time
            assert got["entry"] == "layers.0.w@[0]", f"{name}: {got}"
    assert len(results) == 11


# --------------------------------------------------------------------------- a full disk
@pytest.fixture
def small_disk(tmp_path):
    """A 16 MiB tmpfs (root and mount rights; skipped where mounting fails)."""
    d = str(tmp_path / "disk")
    os.makedirs(d)
    with mounted(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", d], d, "tmpfs"):
        yield d


def _read(path: str) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in mmapckpt.load(path).items()}


@pytest.mark.parametrize("name, to, opts, overwrite", [
    *[(n, t, o, True) for n, t, o in SINKS],  # old 6 MiB + new 12 MiB > 16 MiB
    ("torch", "torch", {}, False),  # the 12 MiB scratch fits, the 12 MiB torch.save beside it does not
], ids=[*(f"{n}-over-an-old-one" for n, _, _ in SINKS), "torch-final-save"])
def test_every_sink_turns_a_full_disk_into_a_checkpoint_write_error(tmp_path, small_disk, name, to, opts, overwrite):
    src, old_src = str(tmp_path / "src"), str(tmp_path / "old")
    mmapckpt.save(_state(1, 12, MiB // 4), src)  # 12 MiB
    mmapckpt.save(_state(2, 6, MiB // 4), old_src)  # 6 MiB
    dst = _dst(small_disk, name)
    if overwrite:
        convert(old_src, dst, to=to, **opts)
        old = _read(dst)
    before = sorted(os.listdir(small_disk))
    with pytest.raises(CheckpointWriteError) as info:
        convert(src, dst, to=to, overwrite=True, **opts)
    msg = str(info.value)
    assert os.strerror(errno.ENOSPC) in msg and dst in msg and "free room for both" in msg, msg
    assert sorted(os.listdir(small_disk)) == before, "the failed conversion left files behind"
    if overwrite:
        got = _read(dst)
        assert set(got) == set(old) and all(tensor_bytes(got[k]) == tensor_bytes(old[k]) for k in old)
    else:
        assert not os.path.lexists(dst)
    small = str(tmp_path / "small")
    mmapckpt.save(_state(3, 2, MiB // 4), small)  # 2 MiB: fits beside the old one, twice for torch's scratch
    convert(small, dst, to=to, overwrite=True, **opts)  # the space is free again, the error still alive
    assert set(_read(dst)) == {"layers.0.w", "layers.1.w"}
    del info


def test_a_dtype_the_mmapckpt_format_cannot_hold_is_named(tmp_path):
    src = str(tmp_path / "f4.pt")
    torch.save({"packed": torch.zeros(4, dtype=torch.uint8).view(torch.float4_e2m1fn_x2), "ok": torch.ones(2)}, src)
    dst = str(tmp_path / "out")
    with pytest.raises(CheckpointError, match="cannot store dtype torch.float4_e2m1fn_x2") as info:
        convert(src, dst, to="mmapckpt")
    assert info.value.entry == "packed@[0]" and not os.path.lexists(dst)
    assert sorted(os.listdir(tmp_path)) == ["f4.pt"]


def test_the_reason_under_torch_saves_runtime_error_is_kept(tmp_path):
    """torch.save reports a failed write as RuntimeError("... unexpected pos ..."): the disk's errno is kept."""
    from mmapckpt.conversion.common import Writing

    class Full:  # a file whose disk fills after 1000 bytes; flush and close succeed (nothing buffered)
        written = 0

        def write(self, b):
            if self.written + len(b) > 1000:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            self.written += len(b)
            return len(b)

        def flush(self):
            pass

    with pytest.raises(CheckpointWriteError) as info:
        with Writing(str(tmp_path / "x.pt")) as w:
            w.entry = "w"
            torch.save(torch.randn(10_000), w.record(Full()))
    assert os.strerror(errno.ENOSPC) in str(info.value) and info.value.entry == "w"
    assert isinstance(info.value.__cause__, OSError) and info.value.__cause__.errno == errno.ENOSPC
    assert isinstance(info.value.__context__, RuntimeError)  # torch's, its frames dropped
    assert info.value.__context__.__traceback__ is None


# --------------------------------------------------------------------------- no permission (issue 42, 7b)
_NOBODY = textwrap.dedent("""
    import json, os, sys, tempfile, warnings
    warnings.simplefilter("ignore")
    import mmapckpt
    from mmapckpt.tools.cli import main
    cases = json.loads(sys.argv[1])
    with tempfile.TemporaryDirectory() as d:  # every module a conversion imports, imported while we may read it
        for case in cases[:3]:
            mmapckpt.convert(case["src"], os.path.join(d, case["to"]), to=case["to"])
    os.setgroups([]); os.setgid(65534); os.setuid(65534)  # nobody: permission bits stop it (they do not stop root)
    out = []
    for case in cases:
        try:
            mmapckpt.convert(case["src"], case["dst"], to=case["to"], overwrite=True)
            got = {"raised": None}
        except BaseException as e:
            got = {"raised": [c.__name__ for c in type(e).__mro__], "message": str(e)}
        got["cli"] = main(["convert", case["src"], case["dst"], "--to", case["to"], "--overwrite", "-q"])
        out.append(got)
    print(json.dumps(out))
""")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run the conversion as another user (nobody)")
def test_convert_overwrite_where_the_process_may_not_write_is_a_checkpoint_write_error():
    """``convert --overwrite`` run as nobody into root's directories: one whose parent nobody may not list
    (the recovery of an interrupted conversion looks there: a raw PermissionError before), one whose parent
    nobody may list but not write, one that is itself unreadable. Each is a CheckpointWriteError naming the
    destination (the CLI exits 1 with it), and the old checkpoint is untouched."""
    tmp_path = pathlib.Path(tempfile.mkdtemp(prefix="mmapckpt-nobody-", dir="/tmp"))  # pytest's is root's alone
    try:
        _as_nobody(tmp_path)
    finally:
        for root, dirs, _ in os.walk(tmp_path):
            for n in dirs:
                os.chmod(os.path.join(root, n), 0o755)
        shutil.rmtree(tmp_path)


def _as_nobody(tmp_path: pathlib.Path) -> None:
    os.chmod(tmp_path, 0o755)
    src = str(tmp_path / "src")
    mmapckpt.save(_state(2, 2, 1000), src)
    for root, _, files in os.walk(src):
        os.chmod(root, 0o755)
        for n in files:
            os.chmod(os.path.join(root, n), 0o644)
    cases, modes = [], [("unlisted-parent", 0o711, 0o755), ("read-only-parent", 0o555, 0o755),
                        ("unreadable-dst", 0o777, 0o700)]
    for name, parent_mode, dst_mode in modes:
        for to in ("mmapckpt", "safetensors", "torch"):
            parent = tmp_path / f"{to}-{name}"
            parent.mkdir()
            dst = str(parent / "dst")
            mmapckpt.save(_state(1, 2, 1000), dst)
            os.chmod(dst, dst_mode)
            os.chmod(parent, parent_mode)
            cases.append({"src": src, "dst": dst, "to": to, "name": f"{to}, {name}"})
    r = subprocess.run([sys.executable, "-c", _NOBODY, json.dumps(cases)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    for case, got in zip(cases, json.loads(r.stdout.splitlines()[-1])):
        assert got["raised"] and "CheckpointWriteError" in got["raised"], f"{case['name']}: {got}"
        assert case["dst"] in got["message"] and os.strerror(errno.EACCES) in got["message"], f"{case['name']}: {got}"
        assert got["cli"] == 1, f"{case['name']}: {got}"
        os.chmod(os.path.dirname(case["dst"]), 0o755)
        os.chmod(case["dst"], 0o755)
        got_back = mmapckpt.load(case["dst"])
        want = _state(1, 2, 1000)
        assert all(tensor_bytes(got_back[k]) == tensor_bytes(want[k]) for k in want), case["name"]
