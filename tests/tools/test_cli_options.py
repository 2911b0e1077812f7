"""inspect's metadata, --keys and lone shard files; convert's inferred format, --dtype, --exclude, Hugging Face side
files and progress (phases, callback, tqdm or the plain bar), through main(argv) and convert()."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import assert_bitwise_equal
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import mmapckpt
from mmapckpt.conversion import progress as progress_module
from mmapckpt.tools.cli import main

SD = {"model.embed.weight": torch.randn(16, 8), "model.norm.weight": torch.randn(8).to(torch.bfloat16),
      "model.idx": torch.arange(5), "optim.exp_avg": torch.randn(16, 8),
      "model.scale": torch.tensor([1.5, -0.0, float("nan")], dtype=torch.float16),
      "model.q": torch.randn(4).to(torch.float8_e4m3fn)}


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def ck(tmp_path) -> str:
    path = str(tmp_path / "ck")
    mmapckpt.save(SD, path, metadata={"step": "1200", "run": "a/b"})
    return path


# --------------------------------------------------------------------------- inspect
def test_inspect_shows_user_metadata_in_text_and_json(capsys, ck, tmp_path) -> None:
    code, out, _ = run(capsys, "inspect", ck)
    assert code == 0 and "metadata:\n  step: 1200\n  run: a/b\n" in out
    code, out, _ = run(capsys, "inspect", ck, "--json")
    assert json.loads(out)["metadata"] == {"step": "1200", "run": "a/b"}
    st = str(tmp_path / "m.safetensors")
    save_file({"a": torch.zeros(2)}, st, metadata={"format": "pt", "author": "me"})
    assert json.loads(run(capsys, "inspect", st, "--json")[1])["metadata"] == {"format": "pt", "author": "me"}
    save_file({"a": torch.zeros(2)}, st)
    code, out, _ = run(capsys, "inspect", st)
    assert "metadata:" not in out and json.loads(run(capsys, "inspect", st, "--json")[1])["metadata"] is None


def test_inspect_keys_selects_entries(capsys, ck) -> None:
    code, out, _ = run(capsys, "inspect", ck, "--json", "--keys", "model.*weight", "--keys", "optim.*")
    names = [e["name"] for e in json.loads(out)["entries"]]
    assert code == 0 and names == ["model.embed.weight", "model.norm.weight", "optim.exp_avg"]
    code, _, err = run(capsys, "inspect", ck, "--keys", "Model.*")
    assert code == 1 and "no entry matches --keys Model.*" in err
    info = mmapckpt.inspect_checkpoint(ck, keys=["model.idx"])
    assert [e.name for e in info.entries] == ["model.idx"] and info.metadata == {"step": "1200", "run": "a/b"}


def test_inspect_names_a_lone_distcp_shard(capsys, ck, tmp_path) -> None:
    code, out, err = run(capsys, "inspect", os.path.join(ck, "__0_0.distcp"))
    assert code == 1 and out == "" and err.count("\n") == 1
    assert "one shard file of an mmapckpt checkpoint (format 1.0, 6 entries)" in err and f"mmapckpt inspect {ck}" in err
    stock = str(tmp_path / "stock")
    dcp.save({"w": torch.ones(3)}, checkpoint_id=stock, no_dist=True)
    code, _, err = run(capsys, "inspect", os.path.join(stock, "__0_0.distcp"))
    assert code == 1 and "a data file of a stock DCP checkpoint" in err and "Weights only" not in err


# --------------------------------------------------------------------------- convert
@pytest.mark.parametrize("name, fmt", [("m.safetensors", "safetensors"), ("m.pt", "torch"), ("m.bin", "torch"),
                                       ("m.PTH", "torch"), ("outdir", "mmapckpt")])
def test_convert_infers_the_format_from_the_extension(capsys, ck, tmp_path, name: str, fmt: str) -> None:
    dst = str(tmp_path / name)
    code, out, err = run(capsys, "convert", ck, dst, "--keys", "model.embed.*")
    assert code == 0, err
    assert f"-> {dst} ({fmt})" in out and mmapckpt.inspect_checkpoint(dst).format == fmt
    assert_bitwise_equal(mmapckpt.load(dst)["model.embed.weight"], SD["model.embed.weight"])


def test_convert_dtype_casts_only_ieee_floats(ck, tmp_path) -> None:
    dst = str(tmp_path / "m.safetensors")
    r = mmapckpt.convert(ck, dst, dtype="bf16")
    assert r.target_format == "safetensors"
    got = load_file(dst)
    for name, t in SD.items():
        want = t.to(torch.bfloat16) if t.dtype in (torch.float32, torch.float16) else t
        assert_bitwise_equal(got[name], want)  # -0.0 and NaN cast as torch casts them; int and fp8 untouched
    assert got["model.q"].dtype == torch.float8_e4m3fn and got["model.idx"].dtype == torch.int64
    back = str(tmp_path / "up")  # a DCP output gets the cast dtype in its metadata too
    mmapckpt.convert(dst, back, to="dcp", dtype=torch.float32)
    sd = {"model.embed.weight": torch.empty(16, 8), "model.norm.weight": torch.empty(8)}
    dcp.load(sd, checkpoint_id=back, no_dist=True)
    assert_bitwise_equal(sd["model.norm.weight"], SD["model.norm.weight"].float())
    with pytest.raises(ValueError, match="unknown dtype"):
        mmapckpt.convert(ck, str(tmp_path / "x.pt"), dtype="int8")


def test_convert_exclude_after_keys(capsys, ck, tmp_path) -> None:
    dst = str(tmp_path / "m.safetensors")
    code, _, err = run(capsys, "convert", ck, dst, "--keys", "model.*", "--exclude", "*.q", "--exclude", "*idx",
                       "--strip-prefix", "model.")
    assert code == 0, err
    with safe_open(dst, "pt") as f:
        assert sorted(f.keys()) == ["embed.weight", "norm.weight", "scale"]
    code, _, err = run(capsys, "convert", ck, str(tmp_path / "n.pt"), "--exclude", "*")
    assert code == 1 and "--exclude * leaves no entry to convert" in err


def test_hugging_face_directory_to_hugging_face_directory_keeps_config_and_tokenizer(capsys, tmp_path) -> None:
    hf = tmp_path / "hf"
    hf.mkdir()
    save_file({"w": torch.randn(4, 4), "b": torch.randn(4)}, str(hf / "model.safetensors"), metadata={"format": "pt"})
    side = {"config.json": b'{"model_type": "bert"}', "generation_config.json": b"{}", "tokenizer.json": b'{"v": 1}',
            "tokenizer_config.json": b"{}", "special_tokens_map.json": b"{}", "vocab.txt": b"[PAD]\n"}
    for name, data in side.items():
        (hf / name).write_bytes(data)
    (hf / "notes.txt").write_bytes(b"not a model file")
    out = tmp_path / "hf_bf16"
    code, _, err = run(capsys, "convert", str(hf), str(out), "--to", "safetensors", "--dtype", "bfloat16",
                       "--max-shard-size", "32B")
    assert code == 0, err
    assert sorted(os.listdir(out)) == sorted([*side, "model-00001-of-00002.safetensors",
                                              "model-00002-of-00002.safetensors", "model.safetensors.index.json"])
    for name, data in side.items():
        assert (out / name).read_bytes() == data
    # not for other outputs: an mmapckpt directory is not a Hugging Face one
    code, _, _ = run(capsys, "convert", str(hf), str(tmp_path / "mm"), "--to", "mmapckpt")
    assert code == 0 and "config.json" not in os.listdir(tmp_path / "mm")


# --------------------------------------------------------------------------- progress
@pytest.mark.parametrize("to", ["torch", "safetensors", "mmapckpt"])
def test_progress_callback_counts_every_phase(ck, tmp_path, to: str, monkeypatch) -> None:
    monkeypatch.setattr(progress_module, "MIN_INTERVAL", 0)  # every step reported, however quick
    calls: list[tuple[str, int, int]] = []
    mmapckpt.convert(ck, str(tmp_path / "out"), to=to, progress=lambda *a: calls.append(a))
    phases = list(dict.fromkeys(p for p, _, _ in calls))
    assert phases == (["assemble", "torch.save", "commit"] if to == "torch" else ["write", "commit"])
    tensor_bytes = sum(t.numel() * t.element_size() for t in SD.values())
    total = calls[-1][2]
    assert total == (2 if to == "torch" else 1) * tensor_bytes
    assert calls[-1] == ("commit", total, total)
    dones = [d for _, d, _ in calls]
    assert dones == sorted(dones) and all(t == total for _, _, t in calls)
    saved = [d for p, d, _ in calls if p == "torch.save"]
    if to == "torch":  # the torch.save phase moves the bar (it sat at the end of the first phase before)
        assert max(saved) > min(saved)


def _convert_on_a_tty(src: str, dst: str, hide_tqdm: bool) -> str:
    """Run the command line with a terminal on stderr (a pty), return what it drew there."""
    import fcntl
    import pty
    import struct
    import termios

    code = ("import sys\n"
            + ("sys.modules['tqdm'] = None\n" if hide_tqdm else "")
            + "from mmapckpt.tools.cli import main\n"
            f"sys.exit(main(['convert', {src!r}, {dst!r}, '--to', 'torch']))\n")
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 160, 0, 0))  # a new pty is 0 columns wide
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=follower,
                         env={**os.environ, "PYTHONWARNINGS": "ignore"})
    os.close(follower)
    chunks = []
    try:
        while True:
            try:
                b = os.read(leader, 65536)
            except OSError:  # EIO: the process closed the terminal
                break
            if not b:
                break
            chunks.append(b)
        p.wait(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        os.close(leader)
    assert p.returncode == 0
    return b"".join(chunks).decode(errors="replace")


def test_progress_on_a_terminal_is_tqdm_or_the_plain_bar(ck, tmp_path) -> None:
    pytest.importorskip("tqdm")
    drawn = _convert_on_a_tty(ck, str(tmp_path / "a.pt"), hide_tqdm=False)
    assert "mmapckpt -> torch: commit: 100%|" in drawn and "<00:00" in drawn  # tqdm: elapsed<ETA
    plain = _convert_on_a_tty(ck, str(tmp_path / "b.pt"), hide_tqdm=True)
    assert "mmapckpt -> torch: commit [########################] 100.0%" in plain and " elapsed, ETA " in plain
    assert "|" not in plain


def test_no_progress_when_stderr_is_not_a_terminal(ck, tmp_path) -> None:
    r = subprocess.run([sys.executable, "-m", "mmapckpt", "convert", ck, str(tmp_path / "c.pt")], capture_output=True,
                       text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"}, timeout=120)
    assert r.returncode == 0 and r.stderr == "" and r.stdout.startswith("converted ")


def test_the_dtype_names_the_parser_accepts_are_the_ones_convert_casts_to() -> None:
    """The parser checks --dtype without importing torch, from its own list: it must be convert's."""
    from mmapckpt.conversion.cast import CAST_DTYPES
    from mmapckpt.tools import cli

    assert set(cli._DTYPES) == set(CAST_DTYPES)
