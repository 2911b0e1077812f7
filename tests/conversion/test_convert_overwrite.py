"""``convert --overwrite``: the destination holds the old or the new checkpoint at every instant,
and files the conversion does not write (configs, tokenizers, notes) are kept.

Outputs are read by the real consumers (mmapckpt.load, safetensors.torch.load_file,
torch.load) and compared byte for byte. Kills are real SIGKILLs of real processes.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
import time
import warnings

import pytest
import torch
from helpers import assert_bitwise_equal, close_fork_server, tensor_bytes
from safetensors.torch import load_file

import mmapckpt
from mmapckpt import CheckpointExistsError, ConversionWarning, convert
from mmapckpt.storage import replace

HF_SHARD = 40_000  # max_shard_size of the sharded outputs below


def _state(seed: int, n: int = 6, numel: int = 4096) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layers.{i}.w": torch.randn(numel, generator=g) for i in range(n)}


def _source(tmp_path, seed: int, **kw) -> str:
    path = str(tmp_path / f"src{seed}")
    if not os.path.exists(path):
        mmapckpt.save(_state(seed, **kw), path)
    return path


def _opts(kind: str) -> dict:
    return {"to": "safetensors", "max_shard_size": HF_SHARD} if kind == "hf" else {"to": kind}


def read_any(path: str) -> dict[str, torch.Tensor]:
    """The tensors at ``path`` through the format's own reader."""
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, "model.safetensors.index.json")):
        with open(os.path.join(path, "model.safetensors.index.json")) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        out: dict[str, torch.Tensor] = {}
        for name in files:
            out.update(load_file(os.path.join(path, name)))
        return out
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, "model.safetensors")):
        return load_file(os.path.join(path, "model.safetensors"))
    if os.path.isdir(path):
        return {k: v.clone() for k, v in mmapckpt.load(path).items()}
    if path.endswith(".safetensors"):
        return load_file(path)
    return torch.load(path, weights_only=True)


def which(path: str, old: dict, new: dict) -> str:
    """'old' or 'new' if ``path`` holds exactly that state, bitwise; fails otherwise."""
    got = read_any(path)
    for name, want in (("old", old), ("new", new)):
        if set(got) == set(want) and all(tensor_bytes(got[k]) == tensor_bytes(want[k]) and got[k].dtype == want[k].dtype
                                         and got[k].shape == want[k].shape for k in want):
            return name
    raise AssertionError(f"{path} holds neither the old nor the new checkpoint: keys {sorted(got)}")


FOREIGN = {"config.json": b'{"model_type": "llama"}', "notes.txt": b"run 7: lr 3e-4\n",
           "tokenizer/vocab.json": b'{"a": 0}', "tokenizer/deep/merges.txt": b"a b\n"}


def add_foreign(d: str, files: dict[str, bytes] = FOREIGN) -> None:
    for rel, data in files.items():
        os.makedirs(os.path.dirname(os.path.join(d, rel)), exist_ok=True)
        with open(os.path.join(d, rel), "wb") as f:
            f.write(data)


def assert_foreign_kept(d: str, files: dict[str, bytes] = FOREIGN) -> None:
    for rel, data in files.items():
        with open(os.path.join(d, rel), "rb") as f:
            assert f.read() == data, f"{rel} changed"


def hidden_siblings(path: str) -> list[str]:
    parent, base = os.path.split(os.path.abspath(path))
    return sorted(n for n in os.listdir(parent) if n.startswith(f".{base}."))


def _checkpoint_files(kind: str, new_src: str, tmp_path) -> set[str]:
    """The names a conversion of ``new_src`` writes into a fresh directory."""
    fresh = str(tmp_path / f"fresh-{kind}")
    convert(new_src, fresh, **_opts(kind))
    return set(os.listdir(fresh))


# --------------------------------------------------------------------------- what is replaced and what is kept
@pytest.mark.parametrize("exchange", [True, False], ids=["exchange", "fallback"])
@pytest.mark.parametrize("kind", ["mmapckpt", "dcp", "hf", "hf-single"])
def test_overwrite_replaces_the_checkpoint_and_keeps_every_other_file(tmp_path, monkeypatch, kind, exchange) -> None:
    monkeypatch.setattr(replace, "EXCHANGE", exchange)
    old_src = _source(tmp_path, 1, n=9)  # more tensors: more shard files than the new checkpoint has
    new_src = _source(tmp_path, 2)
    dst = str(tmp_path / "dst")
    opts = {"to": "safetensors"} if kind == "hf-single" else _opts(kind)
    if kind == "hf-single":  # an HF directory with one model.safetensors replaced by shards
        os.makedirs(dst)
        convert(old_src, os.path.join(dst, "model.safetensors"), to="safetensors")
        opts = _opts("hf")
    elif kind in ("mmapckpt", "dcp"):
        mmapckpt.save(_state(1, n=9), dst, thread_count=3)  # three shard files; the new one has one
    else:
        convert(old_src, dst, **opts)
    add_foreign(dst)
    extra = {"adapter_model.safetensors": b"not ours"} if kind.startswith("hf") else {}
    add_foreign(dst, extra)
    old_files = set(os.listdir(dst))
    convert(new_src, dst, overwrite=True, **opts)
    assert which(dst, _state(1, n=9), _state(2)) == "new"
    assert_foreign_kept(dst)
    assert_foreign_kept(dst, extra)
    written = _checkpoint_files("hf" if kind.startswith("hf") else kind, new_src, tmp_path)
    assert set(os.listdir(dst)) == written | {"config.json", "notes.txt", "tokenizer"} | set(extra)
    assert old_files - set(os.listdir(dst)), "the old checkpoint had files the new one does not write"
    assert hidden_siblings(dst) == []


@pytest.mark.parametrize("kind", ["mmapckpt", "hf", "safetensors-into-dir"])
def test_overwrite_into_a_directory_without_a_checkpoint_keeps_its_files(tmp_path, kind) -> None:
    src = _source(tmp_path, 2)
    dst = str(tmp_path / "hf-model")
    add_foreign(dst, {"config.json": b"{}", "generation_config.json": b'{"top_p": 0.9}'})
    opts = {"to": "safetensors"} if kind == "safetensors-into-dir" else _opts(kind)
    convert(src, dst, overwrite=True, **opts)
    assert_foreign_kept(dst, {"config.json": b"{}", "generation_config.json": b'{"top_p": 0.9}'})
    assert which(dst, {}, _state(2)) == "new"
    if kind == "safetensors-into-dir":  # the Hugging Face name for a model of one file
        assert sorted(os.listdir(dst)) == ["config.json", "generation_config.json", "model.safetensors"]


@pytest.mark.parametrize("kind", ["safetensors", "torch"])
def test_file_outputs_are_replaced_whole(tmp_path, kind) -> None:
    dst = str(tmp_path / ("model.safetensors" if kind == "safetensors" else "model.pt"))
    convert(_source(tmp_path, 1), dst, to=kind)
    convert(_source(tmp_path, 2), dst, to=kind, overwrite=True)
    assert which(dst, _state(1), _state(2)) == "new"
    assert hidden_siblings(dst) == []


def test_a_file_output_never_replaces_a_directory_of_other_files(tmp_path) -> None:
    dst = str(tmp_path / "run")
    mmapckpt.save(_state(1), dst)
    add_foreign(dst)
    with pytest.raises(CheckpointExistsError, match="config.json") as ei:
        convert(_source(tmp_path, 2), dst, to="torch", overwrite=True)
    assert os.path.join(dst, "model.pt") in str(ei.value)
    assert which(dst, _state(1), _state(2)) == "old"
    assert_foreign_kept(dst)
    only = str(tmp_path / "only")  # a directory holding nothing but a checkpoint may become a file
    mmapckpt.save(_state(1), only)
    convert(_source(tmp_path, 2), only, to="torch", overwrite=True)
    assert os.path.isfile(only) and which(only, _state(1), _state(2)) == "new"


def test_a_file_created_in_the_old_directory_during_the_swap_is_kept(tmp_path, monkeypatch) -> None:
    dst = str(tmp_path / "dst")
    convert(_source(tmp_path, 1), dst, to="mmapckpt")
    real = replace.rename_exchange

    def late(a: str, b: str) -> bool:  # a file that appears after the others were carried over
        with open(os.path.join(b, "late.txt"), "wb") as f:
            f.write(b"written during the conversion")
        return real(a, b)

    monkeypatch.setattr(replace, "rename_exchange", late)
    convert(_source(tmp_path, 2), dst, to="mmapckpt", overwrite=True)
    assert_foreign_kept(dst, {"late.txt": b"written during the conversion"})
    assert which(dst, _state(1), _state(2)) == "new" and hidden_siblings(dst) == []


def _exchange_available(tmp_path) -> bool:
    a, b = tmp_path / "probe-a", tmp_path / "probe-b"
    a.mkdir(), b.mkdir()
    try:
        return replace._call_renameat2(str(a), str(b), 2)  # RENAME_EXCHANGE, whatever replace.EXCHANGE says
    finally:
        a.rmdir(), b.rmdir()


def test_exchange_swaps_two_directories_in_one_step(tmp_path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    add_foreign(str(a), {"x": b"A"})
    add_foreign(str(b), {"y": b"B"})
    if not replace.rename_exchange(str(a), str(b)):
        pytest.skip("renameat2(RENAME_EXCHANGE) is unavailable on this file system")
    assert os.listdir(a) == ["y"] and os.listdir(b) == ["x"]


# --------------------------------------------------------------------------- interrupted replacements
_CHILD = textwrap.dedent("""
    import importlib, os, sys
    from mmapckpt.storage import replace
    from mmapckpt.tools.cli import main
    where, exchange = sys.argv[1], sys.argv[2] == "1"
    replace.EXCHANGE = exchange
    def die(*a, **k):  # the process dies here, as a SIGKILL would leave it
        os._exit(9)
    module, _, name = where.rpartition(".")
    setattr(importlib.import_module(module), name, die)
    sys.exit(main(sys.argv[3:]))
""")


def _child(where: str, exchange: bool, *argv: str) -> int:
    return subprocess.run([sys.executable, "-c", _CHILD, where, "1" if exchange else "0", *argv],
                          capture_output=True, timeout=120).returncode


def _old_dir(tmp_path, kind: str = "mmapckpt") -> str:
    dst = str(tmp_path / "dst")
    convert(_source(tmp_path, 1), dst, **_opts(kind))
    add_foreign(dst)
    return dst


@pytest.mark.parametrize("kind", ["mmapckpt", "hf"])
def test_fallback_killed_between_its_two_renames_is_restored_by_the_next_convert(tmp_path, kind) -> None:
    dst = _old_dir(tmp_path, kind)
    to = ["--to", "safetensors", "--max-shard-size", str(HF_SHARD)] if kind == "hf" else ["--to", kind]
    assert _child("mmapckpt.storage.replace._rename_in", False, "convert", _source(tmp_path, 2), dst, *to, "--overwrite", "-q") == 9
    assert not os.path.exists(dst)  # the window the fallback has: the old one is aside, the new not yet in
    assert os.path.isfile(replace.journal_path(dst))
    with pytest.warns(ConversionWarning, match="restored the previous version"):
        with pytest.raises(CheckpointExistsError):  # the old one is back, so a plain convert is refused
            convert(_source(tmp_path, 2), dst, **_opts(kind))
    assert which(dst, _state(1), _state(2)) == "old"
    assert_foreign_kept(dst)
    assert hidden_siblings(dst) == []
    convert(_source(tmp_path, 2), dst, overwrite=True, **_opts(kind))
    assert which(dst, _state(1), _state(2)) == "new"
    assert_foreign_kept(dst)


@pytest.mark.parametrize("exchange", [True, False], ids=["exchange", "fallback"])
def test_killed_after_the_swap_the_next_convert_retires_the_old_one(tmp_path, exchange) -> None:
    dst = _old_dir(tmp_path)
    assert _child("mmapckpt.storage.replace._retire", exchange, "convert", _source(tmp_path, 2), dst, "--to", "mmapckpt", "--overwrite",
                  "-q") == 9
    assert which(dst, _state(1), _state(2)) == "new"
    assert_foreign_kept(dst)
    assert len(hidden_siblings(dst)) == 2  # the journal and the old directory
    with pytest.warns(ConversionWarning, match="finished the replacement"):
        convert(_source(tmp_path, 1), dst, to="mmapckpt", overwrite=True)
    assert which(dst, _state(1), _state(2)) == "old"
    assert_foreign_kept(dst)
    assert hidden_siblings(dst) == []


def test_the_exchange_leaves_no_instant_without_the_destination(tmp_path) -> None:
    """A process that would die between the fallback's renames never gets there with the exchange."""
    dst = _old_dir(tmp_path)
    if not _exchange_available(tmp_path):
        pytest.skip("renameat2(RENAME_EXCHANGE) is unavailable on this file system")
    assert _child("mmapckpt.storage.replace._aside", True, "convert", _source(tmp_path, 2), dst, "--to", "mmapckpt", "--overwrite", "-q") == 0
    assert which(dst, _state(1), _state(2)) == "new"
    assert_foreign_kept(dst)
    assert hidden_siblings(dst) == []


def test_temp_files_of_a_killed_conversion_are_removed_by_the_next(tmp_path) -> None:
    dst = _old_dir(tmp_path)
    assert _child("mmapckpt.storage.replace.replace_path", True, "convert", _source(tmp_path, 2), dst, "--to", "mmapckpt", "--overwrite",
                  "-q") == 9
    assert len(hidden_siblings(dst)) == 1  # the finished but never swapped-in new checkpoint
    assert which(dst, _state(1), _state(2)) == "old"
    convert(_source(tmp_path, 2), dst, to="mmapckpt", overwrite=True)
    assert hidden_siblings(dst) == [] and which(dst, _state(1), _state(2)) == "new"


# --------------------------------------------------------------------------- SIGKILL at random instants
_ZYGOTE = textwrap.dedent("""
    import json, os, sys
    import mmapckpt, mmapckpt.conversion.driver, safetensors.torch  # imported once, before the forks
    from mmapckpt.storage import replace
    from mmapckpt.tools.cli import main
    while line := sys.stdin.readline():   # one conversion per line, each in a forked child the test kills
        cmd = json.loads(line)
        pid = os.fork()
        if pid == 0:
            replace.EXCHANGE = cmd["exchange"]
            code = 1
            try:
                code = main(cmd["argv"])
            finally:
                os._exit(code)
        print(pid, flush=True)
        sys.stdin.readline()  # reaped only when the test says so: its kill never meets a reused pid
        _, status = os.waitpid(pid, 0)
        print(status, flush=True)
""")


class Zygote:
    """A process with torch and mmapckpt imported that forks one conversion per request."""

    def __init__(self) -> None:
        self.p = subprocess.Popen([sys.executable, "-c", _ZYGOTE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  text=True)
        self.child: int | None = None  # started and not yet reaped: its pid is still its own

    def run(self, argv: list[str], exchange: bool, delay: float | None) -> bool:
        """Run ``convert argv``; SIGKILL it after ``delay`` s. True if the kill landed before it ended."""
        assert self.p.stdin and self.p.stdout
        self.p.stdin.write(json.dumps({"argv": argv, "exchange": exchange}) + "\n")
        self.p.stdin.flush()
        pid = self.child = int(self.p.stdout.readline())
        if delay is not None:
            time.sleep(delay)
            os.kill(pid, 9)  # running or a zombie: the zygote reaps it only after the next line
        self.child = None  # once told, the zygote may reap it and its pid may be reused
        self.p.stdin.write("reap\n")
        self.p.stdin.flush()
        status = int(self.p.stdout.readline())
        assert os.WIFSIGNALED(status) or os.WEXITSTATUS(status) == 0, f"convert failed: status {status}"
        return os.WIFSIGNALED(status)

    def close(self) -> None:
        close_fork_server(self.p, self.child)


def _kill_trials(tmp_path, zygote: Zygote, kind: str, exchange: bool, trials: int, rng: random.Random) -> dict:
    old_src = _source(tmp_path, 11, n=8, numel=1 << 20)  # 32 MiB each, different data
    new_src = _source(tmp_path, 12, n=8, numel=1 << 20)
    old, new = read_any(old_src), read_any(new_src)
    dst = str(tmp_path / f"{int(exchange)}" / {"safetensors": "m.safetensors", "torch": "m.pt"}.get(kind, kind))
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    convert(old_src, dst, **_opts(kind))
    is_dir = os.path.isdir(dst)
    if is_dir:
        add_foreign(dst)
    argv = ["convert", new_src, dst, "--to", _opts(kind)["to"], "--overwrite", "-q"]
    if kind == "hf":
        argv += ["--max-shard-size", "12MB"]
    spans = []
    for _ in range(2):  # whole runs: how long a conversion takes here
        t0 = time.monotonic()
        zygote.run(argv, exchange, None)
        spans.append(time.monotonic() - t0)
        assert which(dst, old, new) == "new"
    span = min(spans)
    counts = {"old": 0, "new": 0, "killed": 0, "repaired": 0, "span_ms": round(span * 1000)}
    for _ in range(trials):
        convert(old_src, dst, overwrite=True, **({"max_shard_size": "12MB"} if kind == "hf" else {}),
                to=_opts(kind)["to"])  # back to the old one: the following convert succeeds
        assert which(dst, old, new) == "old" and hidden_siblings(dst) == []
        counts["killed"] += zygote.run(argv, exchange, rng.uniform(0.2, 1.1) * span)
        if not exchange and not os.path.lexists(dst):
            # killed between the fallback's two renames: the one state it documents as repaired by the
            # next convert (docs/reliability.md), which runs this recovery first
            assert replace.recover(dst) == "restored the previous version"
            counts["repaired"] += 1
        counts[which(dst, old, new)] += 1  # raises if the destination is missing, damaged or mixed
        if is_dir:
            assert_foreign_kept(dst)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConversionWarning)
        convert(new_src, dst, overwrite=True, to=_opts(kind)["to"], **({"max_shard_size": "12MB"} if kind == "hf" else {}))
    assert which(dst, old, new) == "new" and hidden_siblings(dst) == []
    return counts


@pytest.mark.slow
def test_sigkill_at_random_instants_leaves_old_or_new(tmp_path) -> None:
    rng = random.Random(int(os.environ.get("MMAPCKPT_KILL_SEED", "7")))
    plan = [("mmapckpt", True, 12), ("hf", True, 10), ("safetensors", True, 8), ("torch", True, 6),
            ("mmapckpt", False, 12)]
    zygote = Zygote()
    figures = {}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConversionWarning)  # recoveries say what they did
            for kind, exchange, n in plan:
                figures[f"{kind}{'' if exchange else ' (fallback)'}"] = _kill_trials(tmp_path, zygote, kind, exchange,
                                                                                     n, rng)
    finally:
        zygote.close()
    total = {k: sum(f[k] for f in figures.values()) for k in ("old", "new", "killed")}
    print(f"\nconvert --overwrite kill trials: {sum(n for *_, n in plan)} trials, {total['killed']} killed "
          f"before the end, ended old {total['old']}, new {total['new']}, lost 0; per output: {figures}")
    assert total["old"] + total["new"] == sum(n for *_, n in plan) >= 30
    assert total["killed"] >= 15  # most kills land while the conversion runs
    assert total["old"] >= 5  # and many before the swap: the old one survives them
