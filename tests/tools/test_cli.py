"""The command line, through main(argv) and once as real subprocesses (python -m and the console script)."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import assert_bitwise_equal
from safetensors import safe_open

import mmapckpt
from mmapckpt import CheckpointExistsError, MmapWriter
from mmapckpt.conversion.progress import Progress, human_bytes
from mmapckpt.reading.shard import Shard
from mmapckpt.tools.cli import main

SD = {"enc.w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "enc.b": torch.ones(3, dtype=torch.bfloat16),
      "step": 5}


@pytest.fixture
def ck(tmp_path) -> str:
    path = str(tmp_path / "ck")
    dcp.save(SD, storage_writer=MmapWriter(path), no_dist=True)
    return path


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_help_lists_every_command(capsys) -> None:
    code, out, _ = run(capsys, "--help")
    assert code == 0
    for cmd in ("demo", "inspect", "verify", "convert", "bench"):
        assert cmd in out
    code, out, _ = run(capsys, "--version")
    assert code == 0 and mmapckpt.__version__ in out


def test_usage_errors_exit_2(capsys) -> None:
    assert run(capsys, )[0] == 2
    code, _, err = run(capsys, "convert", "a")  # DST missing
    assert code == 2 and "dst" in err
    code, _, err = run(capsys, "convert", "a", "b", "--to", "onnx")
    assert code == 2 and "invalid choice" in err
    # checked while parsing, before the source is even looked at (exit 1 with "invalid size" before)
    code, _, err = run(capsys, "convert", "a", "b", "--to", "safetensors", "--max-shard-size", "5XB")
    assert code == 2 and "--max-shard-size: invalid size '5XB'" in err
    code, _, err = run(capsys, "convert", "a", "b.safetensors", "--dtype", "int8")
    assert code == 2 and "--dtype: unknown dtype 'int8'" in err
    code, _, err = run(capsys, "convert", "a", "b.pt", "--max-shard-size", "5GB")
    assert code == 2 and "only to safetensors output, not torch" in err


def test_inspect_table_and_json(capsys, ck) -> None:
    code, out, err = run(capsys, "inspect", ck)
    assert code == 0 and err == ""
    assert out.splitlines()[0].startswith(f"{ck}: mmapckpt (shard format 1.0")
    rows = {line.split()[0]: line.split() for line in out.splitlines()[2:] if line and not line.startswith("total")}
    assert rows["enc.w"][:4] == ["enc.w", "float32", "[3,", "4]"] and rows["enc.w"][-2:] == ["48", "B"]
    assert rows["enc.b"][1:3] == ["bfloat16", "[3]"] and rows["step"][1] == "(object)"
    assert "total: 3 entries (2 tensors, 1 non-tensor)" in out
    code, out, _ = run(capsys, "inspect", ck, "--json")
    doc = json.loads(out)
    assert doc["format"] == "mmapckpt" and doc["totals"]["tensors"] == 2 and doc["totals"]["entries"] == 3
    by = {e["name"]: e for e in doc["entries"]}
    assert by["enc.w"] == {"name": "enc.w", "kind": "tensor", "dtype": "float32", "shape": [3, 4], "chunks": 1,
                           "nbytes": 48}
    assert by["step"]["kind"] == "bytes" and by["step"]["nbytes"] > 0
    assert doc["totals"]["bytes"] == sum(e["nbytes"] for e in doc["entries"])


def test_inspect_says_what_stock_readers_need(capsys, ck, tmp_path) -> None:
    code, out, _ = run(capsys, "inspect", ck)
    assert code == 0 and "cannot read this format" in out and "--to dcp" in out
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.ones(2)}, storage_writer=dcp.FileSystemWriter(tmp_path / "stock"), no_dist=True)
    code, out, _ = run(capsys, "inspect", str(tmp_path / "stock"))
    assert code == 0 and "cannot read this format" not in out  # a stock checkpoint needs no note


def test_inspect_every_format(capsys, ck, tmp_path) -> None:
    for to, name in (("dcp", "d"), ("safetensors", "s.safetensors"), ("torch", "t.pt")):
        assert run(capsys, "convert", ck, str(tmp_path / name), "--to", to, "-q")[0] == 0
        code, out, _ = run(capsys, "inspect", str(tmp_path / name), "--json")
        doc = json.loads(out)
        assert code == 0 and doc["format"] == to
        assert {e["name"]: e["shape"] for e in doc["entries"] if e["kind"] == "tensor"} == {"enc.w": [3, 4], "enc.b": [3]}


def test_verify_sound_and_damaged(capsys, ck) -> None:
    code, out, _ = run(capsys, "verify", ck)
    assert code == 0 and out.rstrip().endswith("bytes checked)") and "sound" in out
    assert out.count("\nok ") + out.startswith("ok ") >= 3
    shard = os.path.join(ck, "__0_0.distcp")
    e = next(e for e in Shard(shard).header.entries if e.fqn == "enc.w")
    with open(shard, "r+b") as f:
        f.seek(e.offset + 5)
        f.write(b"\x7f")
    code, out, _ = run(capsys, "verify", ck)
    assert code == 1 and "NOT sound: 1 problem" in out
    assert [line for line in out.splitlines() if line.startswith("PROBLEM")] == [
        f"PROBLEM  {shard}: entry 'enc.w@[0, 0]': " + next(l for l in out.splitlines() if "CRC-32" in l).split(": ", 2)[2]]
    code, out, _ = run(capsys, "verify", ck, "--json")
    doc = json.loads(out)
    assert code == 1 and doc["ok"] is False and doc["problems"][0]["entry"] == "enc.w@[0, 0]"
    code, out, _ = run(capsys, "verify", ck, "--quiet")
    assert code == 1 and not any(line.startswith("ok") for line in out.splitlines())


def test_verify_prints_unreferenced_files_as_warnings(capsys, ck) -> None:
    with open(os.path.join(ck, "config.json"), "wb") as f:
        f.write(b"{}" * 1000)
    code, out, _ = run(capsys, "verify", ck)
    lines = out.splitlines()
    assert code == 0 and not any(line.startswith("PROBLEM") for line in lines)
    warned = [line for line in lines if line.startswith("warning  ")]
    assert warned == [f"warning  {os.path.join(ck, 'config.json')}: not referenced by the metadata: not part of the "
                      "checkpoint (kept; verify did not check it) (2.0 KiB)"]
    assert lines[-1].startswith(f"{ck}: sound (") and lines[-1].endswith("; 1 unreferenced file)")
    doc = json.loads(run(capsys, "verify", ck, "--json")[1])
    assert doc["ok"] is True and doc["warnings"] == [{"path": os.path.join(ck, "config.json"), "bytes": 2000,
                                                      "message": warned[0].split(": ", 1)[1].rsplit(" (", 1)[0]}]


def test_convert_then_refuse_then_overwrite(capsys, ck, tmp_path) -> None:
    dst = str(tmp_path / "m.safetensors")
    code, out, err = run(capsys, "convert", ck, dst, "--to", "safetensors")
    assert code == 0 and "converted" in out and "(mmapckpt) ->" in out
    assert err.strip() == "mmapckpt: warning: 1 non-tensor entries were not converted (safetensors holds only tensors): step"
    with safe_open(dst, framework="pt") as f:
        assert_bitwise_equal(f.get_tensor("enc.w"), SD["enc.w"])
    code, out, err = run(capsys, "convert", ck, dst, "--to", "safetensors")
    assert code == 1 and out == ""
    assert err.count("\n") == 1 and err.startswith("mmapckpt: error: ") and "--overwrite" in err
    assert "Traceback" not in err
    assert run(capsys, "convert", ck, dst, "--to", "safetensors", "--overwrite", "--quiet")[0] == 0
    code, _, err = run(capsys, "convert", ck, str(tmp_path / "sh"), "--to", "safetensors", "--max-shard-size", "40B", "-q")
    assert code == 0 and os.path.isfile(tmp_path / "sh" / "model.safetensors.index.json")


def test_errors_are_one_line_unless_debug(capsys, tmp_path, ck) -> None:
    code, _, err = run(capsys, "inspect", str(tmp_path / "missing"))
    assert code == 1 and err == f"mmapckpt: error: {tmp_path / 'missing'}: no such file or directory\n"
    code, _, err = run(capsys, "convert", ck, str(tmp_path / "x"), "--to", "dcp", "--keys", "nothing.*")
    assert code == 1 and err.startswith(f"mmapckpt: error: {ck}: no entry matches --keys") and err.count("\n") == 1
    run(capsys, "convert", ck, str(tmp_path / "y"), "--to", "dcp", "-q")
    with pytest.raises(CheckpointExistsError):
        main(["--debug", "convert", ck, str(tmp_path / "y"), "--to", "dcp"])
    with pytest.raises(CheckpointExistsError):
        main(["convert", ck, str(tmp_path / "y"), "--to", "dcp", "--debug"])


def test_a_broken_subcommand_module_affects_only_itself(capsys, monkeypatch, ck) -> None:
    monkeypatch.setitem(sys.modules, "mmapckpt.bench.demo", None)  # importing it now raises ImportError
    code, _, err = run(capsys, "demo", "--anything")
    assert code == 1 and err.startswith("mmapckpt: error: the 'demo' command is unavailable: ModuleNotFoundError")
    assert run(capsys, "inspect", ck)[0] == 0
    assert run(capsys, "--help")[0] == 0


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_plain_progress_bar_on_a_terminal_only(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "tqdm", None)  # the fallback, drawn where tqdm is not installed
    tty = _Tty()
    with Progress(4 << 20, "copy", stream=tty, min_interval=0) as bar:
        bar.phase("read", 2 << 20)
        bar.advance(1 << 20)
        bar.phase("write", 2 << 20)  # the read's missing MiB counts as done when the next phase starts
        bar.advance(2 << 20)
    text = tty.getvalue()
    assert text.startswith("\rcopy: read [") and text.endswith("\n")
    assert " 25.0% 1.0 MiB / 4.0 MiB" in text and "copy: write [" in text and "100.0% 4.0 MiB / 4.0 MiB" in text
    assert " elapsed, ETA " in text and "/s" in text
    for stream, enabled in ((io.StringIO(), True), (_Tty(), False)):
        with Progress(10, "x", stream=stream, enabled=enabled, min_interval=0) as bar:
            bar.advance(10)
        assert stream.getvalue() == ""
    assert human_bytes(1023) == "1023 B" and human_bytes(1536) == "1.5 KiB" and human_bytes(3 << 30) == "3.0 GiB"


def test_tqdm_progress_bar_where_installed() -> None:
    pytest.importorskip("tqdm")
    tty = _Tty()
    with Progress(4 << 20, "copy", stream=tty, min_interval=0) as bar:
        bar.phase("write", 4 << 20)
        bar.advance(1 << 20)
        bar.advance(3 << 20)
    text = tty.getvalue()
    assert "copy: write: 100%|" in text and "4.00M/4.00M" in text  # tqdm's bar, with elapsed<remaining
    assert "[00:00<00:00" in text and "B/s]" in text
    quiet = io.StringIO()  # not a terminal: tqdm is not even started
    with Progress(10, "x", stream=quiet, min_interval=0) as bar:
        bar.advance(10)
    assert quiet.getvalue() == ""


def test_progress_callback_hears_every_phase_to_the_end() -> None:
    calls: list[tuple[str, int, int]] = []
    with Progress(100, "x", enabled=False, min_interval=0, callback=lambda *a: calls.append(a)) as bar:
        bar.phase("a", 60)
        bar.advance(50)
        bar.advance(50)  # more than the phase's bytes: capped, the total is never passed
        bar.phase("b", 40)
        bar.advance(10)
    assert calls[0] == ("a", 0, 100) and ("a", 60, 100) in calls and ("b", 60, 100) in calls
    assert calls[-1] == ("b", 100, 100)
    assert [d for _, d, _ in calls] == sorted(d for _, d, _ in calls)


def _script() -> list[str]:
    exe = os.path.join(os.path.dirname(sys.executable), "mmapckpt")
    found = exe if os.path.exists(exe) else shutil.which("mmapckpt")
    if not found:
        pytest.skip("the mmapckpt console script is not installed")
    return [found]


def test_as_subprocesses(ck, tmp_path) -> None:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    p = subprocess.run([sys.executable, "-m", "mmapckpt", "inspect", ck, "--json"], capture_output=True, text=True,
                       env=env, timeout=120)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["totals"]["tensors"] == 2
    p = subprocess.run(_script() + ["convert", ck, str(tmp_path / "t.pt"), "--to", "torch"], capture_output=True,
                       text=True, env=env, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stderr == ""  # stderr is a pipe: no progress bar
    out = torch.load(tmp_path / "t.pt", weights_only=True)
    assert_bitwise_equal(out["enc.b"], SD["enc.b"]) and out["step"] == 5
    p = subprocess.run(_script() + ["verify", str(tmp_path / "nope")], capture_output=True, text=True, env=env,
                       timeout=120)
    assert p.returncode == 1 and p.stderr.startswith("mmapckpt: error:") and "Traceback" not in p.stderr


@pytest.mark.parametrize("damage", ["missing", "truncated"])
def test_inspect_exits_non_zero_on_a_missing_or_truncated_shard(capsys, tmp_path, damage) -> None:
    import torch.distributed.checkpoint as dcp

    for kind, writer in (("mm", MmapWriter), ("stock", dcp.FileSystemWriter)):
        path = tmp_path / kind
        dcp.save({"w": torch.arange(4096.0), "b": torch.ones(3)}, storage_writer=writer(path), no_dist=True)
        shard = next(p for p in path.iterdir() if p.name.endswith(".distcp"))
        if damage == "missing":
            shard.unlink()
        else:
            os.truncate(shard, 2000)
        code, _, err = run(capsys, "inspect", str(path))
        assert code == 1 and shard.name in err, (kind, err)
        want = "missing" if damage == "missing" else "past the end" if kind == "mm" else "its records reach byte"
        assert want in err, err
