"""The command line as a Unix tool: it starts without torch, exits quietly into a closed pipe, and on Ctrl-C
or kill -9 leaves no temporary file behind (or one, that the next conversion removes).

Every test runs real ``python -m mmapckpt`` processes and kills each one it starts, by pid, in a finally.
"""

from __future__ import annotations

import os
import signal
import socket
import hashlib
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import save_file

import mmapckpt

ENV = {**os.environ, "PYTHONWARNINGS": "ignore"}


def _sigint_as_a_terminal_gives_it() -> None:
    """In the child, before exec: SIGINT handled by default and not blocked, whatever the test runner's process
    had (an ignored or blocked SIGINT is inherited through exec, and a CLI started so never sees Ctrl-C: a CI run
    under pytest-xdist had it so)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def _cli(*argv: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "mmapckpt", *argv], env=ENV,
                            preexec_fn=_sigint_as_a_terminal_gives_it, **kw)


def _stop(p: subprocess.Popen) -> None:
    if p.poll() is None:
        os.kill(p.pid, signal.SIGKILL)
    p.wait(timeout=60)


def _run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True, timeout=120)


# --------------------------------------------------------------------------- start fast
@pytest.mark.parametrize("flag", ["--help", "--version"])
def test_help_and_version_import_no_torch(flag: str) -> None:
    code = ("import runpy, sys\n"
            f"sys.argv = ['mmapckpt', {flag!r}]\n"
            "try:\n"
            "    runpy.run_module('mmapckpt', run_name='__main__', alter_sys=True)\n"
            "except SystemExit as e:\n"
            "    assert e.code in (0, None), e.code\n"
            "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'numpy', 'safetensors')))\n"
            "assert not bad, bad\n")
    r = _run_python(code)
    assert r.returncode == 0, r.stderr
    assert ("usage: mmapckpt" if flag == "--help" else f"mmapckpt {mmapckpt.__version__}") in r.stdout


def test_subcommand_help_imports_no_torch() -> None:
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "mmapckpt", "convert", "--help"], env=ENV,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "--dtype" in r.stdout and "--exclude" in r.stdout
    imported = [line.rsplit("|", 1)[-1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")]
    assert "mmapckpt.tools.cli" in imported and not [m for m in imported if m.split(".")[0] == "torch"]


# --------------------------------------------------------------------------- pipes
def test_a_closed_pipe_ends_inspect_quietly(tmp_path) -> None:
    """``mmapckpt inspect CKPT | head -1``: more output than a pipe holds (64 KiB), the reader leaves after one
    line. Exit status 141 (128 + SIGPIPE, what a shell shows for ``yes | head -1``), nothing on stderr."""
    path = str(tmp_path / "many.safetensors")
    save_file({f"layers.{i}.weight": torch.zeros(1) for i in range(4000)}, path)
    p = _cli("inspect", path, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        first = p.stdout.readline()
        p.stdout.close()  # head -1 exits
        err = p.stderr.read()
        p.wait(timeout=120)
    finally:
        _stop(p)
    assert first.startswith(path.encode() + b": safetensors")
    assert err == b"" and p.returncode == 141


def test_a_closed_pipe_through_a_shell_pipeline(tmp_path) -> None:
    path = str(tmp_path / "many.safetensors")
    save_file({f"layers.{i}.weight": torch.zeros(1) for i in range(4000)}, path)
    cmd = f"{sys.executable} -m mmapckpt inspect {path} --json | head -3; echo \"status ${{PIPESTATUS[0]}}\" >&2"
    r = subprocess.run(["bash", "-c", cmd], env=ENV, capture_output=True, text=True, timeout=120)
    assert r.stdout.splitlines()[0] == "{" and len(r.stdout.splitlines()) == 3
    assert r.stderr == "status 141\n"


# --------------------------------------------------------------------------- Ctrl-C and kill -9
def _big_checkpoint(tmp_path, mib: int) -> str:
    src = str(tmp_path / "src")
    n = mib << 18  # float32 elements in mib MiB
    mmapckpt.save({f"w{i}": torch.randn(n // 8) for i in range(8)}, src)
    return src


def _temps(directory: str, name: str) -> list[str]:
    return sorted(n for n in os.listdir(directory) if n.startswith(f".{name}."))


def _size(path) -> int:
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        return 0


def _wait_for(p: subprocess.Popen, ready, what: str) -> bool:
    """Poll until ``ready()``; False if the process ended first (it was too quick for this size)."""
    deadline = time.monotonic() + 120
    while not ready():
        if p.poll() is not None:
            return False
        assert time.monotonic() < deadline, f"the conversion never reached {what}"
        time.sleep(0.0005)
    return True


@pytest.mark.parametrize("phase", ["assemble", "torch.save"])
def test_ctrl_c_during_convert_exits_130_with_one_line_and_no_temp_file(tmp_path, phase: str) -> None:
    """SIGINT while the scratch file is written, or while torch.save writes the output (where it used to
    become torch's "[enforce fail at inline_container.cc]" and exit 1)."""
    for mib in (48, 160):  # a bigger checkpoint where the machine was too quick to catch the phase
        out = tmp_path / f"run{mib}"
        out.mkdir()
        src = _big_checkpoint(out, mib)

        def in_phase() -> bool:
            names = _temps(str(out), "model.pt")
            if phase == "assemble":
                return any(".scratch-" in n for n in names)
            return any(".scratch-" not in n and _size(out / n) > 4096 for n in names)  # torch.save is writing

        p = _cli("convert", src, str(out / "model.pt"), "--to", "torch", stdout=subprocess.PIPE,
                 stderr=subprocess.PIPE, text=True)
        try:
            if not _wait_for(p, in_phase, phase):
                continue
            os.kill(p.pid, signal.SIGINT)
            stdout, stderr = p.communicate(timeout=120)
        finally:
            _stop(p)
        if p.returncode == 0:  # it finished between our look and the signal
            continue
        assert (p.returncode, stderr, stdout) == (130, "mmapckpt: interrupted\n", "")
        assert _temps(str(out), "model.pt") == [] and not (out / "model.pt").exists()
        return
    pytest.skip(f"every conversion finished before the {phase} phase could be interrupted")


def test_ctrl_c_while_starting_is_one_line(tmp_path) -> None:
    """SIGINT while torch is being imported (the first second of a conversion): no 40-line traceback."""
    src = _big_checkpoint(tmp_path, 1)
    p = subprocess.Popen([sys.executable, "-X", "importtime", "-m", "mmapckpt", "convert", src,
                          str(tmp_path / "m.safetensors")], env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, preexec_fn=_sigint_as_a_terminal_gives_it)
    try:
        for line in p.stderr:  # -X importtime reports each import as it completes
            if line.rsplit("|", 1)[-1].strip().startswith("torch."):
                os.kill(p.pid, signal.SIGINT)
                break
        rest = p.stderr.read()
        p.wait(timeout=120)
    finally:
        _stop(p)
    lines = [ln for ln in rest.splitlines() if not ln.startswith("import time:")]
    assert p.returncode == 130 and lines == ["mmapckpt: interrupted"]
    assert _temps(str(tmp_path), "m.safetensors") == []


def _swallowing_import(*args, **kwargs):
    """Library code that catches everything: the Ctrl-C it receives is lost."""
    try:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(1)  # the handler runs here and its KeyboardInterrupt is swallowed below
    except BaseException:  # noqa: BLE001 - what the library does, not what we do
        pass


def test_a_ctrl_c_that_a_library_swallows_still_ends_the_command(tmp_path, monkeypatch, capsys) -> None:
    """SIGINT whose KeyboardInterrupt a library catches whole (a bare except): the command still ends with one
    line and 130 (before, it ran on and exited 0)."""
    from mmapckpt.tools import cli

    src = _big_checkpoint(tmp_path, 1)
    monkeypatch.setattr(cli, "_run_convert", lambda args: _swallowing_import() or 0)  # the command then succeeds
    old_handler = signal.signal(signal.SIGINT, signal.default_int_handler)  # as Python starts, whatever ran before
    old_mask = signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    try:
        assert cli.main(["convert", src, str(tmp_path / "m.safetensors")]) == 130
    finally:
        signal.signal(signal.SIGINT, old_handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
    assert capsys.readouterr().err.splitlines() == ["mmapckpt: interrupted"]


def _host() -> str:
    return hashlib.sha1(socket.gethostname().encode()).hexdigest()[:8]


def test_kill_9_leaves_one_temp_sibling_that_the_next_run_removes(tmp_path) -> None:
    src = _big_checkpoint(tmp_path, 48)
    out = tmp_path / "out"
    out.mkdir()
    # Files the cleanup must never touch: a name of ours whose writer is alive (this test), one of another
    # host, a user's file that only looks similar, and the new-version sibling of a journaled replacement.
    keep = [f".a.pt.tmp-h{_host()}-{os.getpid()}-0123abcd", ".b.pt.tmp-hffffffff-999999999-0123abcd",
            ".notes.tmp-backup", ".c.pt.tmp-h{}-999999999-0123abcd".format(_host()), ".c.pt.replace-journal"]
    for name in keep:
        (out / name).write_bytes(b"x")
    for _ in range(3):
        p = _cli("convert", src, str(out / "model.pt"), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            caught = _wait_for(p, lambda: bool(_temps(str(out), "model.pt")), "its first temp file")
            if caught:
                os.kill(p.pid, signal.SIGKILL)
        finally:
            _stop(p)
        if caught:
            break
        os.unlink(out / "model.pt")
    else:
        pytest.skip("every conversion finished before it could be killed")
    left = _temps(str(out), "model.pt")
    assert len(left) == 1 and f"-{p.pid}-" in left[0]  # the scratch file, or the torch.save output: never both
    # The next run, into another name in the same directory, removes it; every file above stays.
    r = subprocess.run([sys.executable, "-m", "mmapckpt", "convert", src, str(out / "other.safetensors"), "-q"],
                       env=ENV, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert _temps(str(out), "model.pt") == []
    assert sorted(os.listdir(out)) == sorted(keep + ["other.safetensors"])
