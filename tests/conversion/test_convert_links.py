"""``convert --overwrite`` onto a destination that is a symbolic link: the link is kept, what it names is replaced.

A link to a directory (absolute, relative, a chain of links) gets the new checkpoint in the
linked directory, whose other files are kept; a link to a file (``model.safetensors ->
../../blobs/...``) gets the file it names replaced, crash-safely; a dangling link is refused.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from helpers import add_foreign, foreign_kept, tensor_bytes
from safetensors.torch import load_file

import mmapckpt
from mmapckpt import CheckpointExistsError, CheckpointWriteError, ConversionWarning, convert
from mmapckpt.storage import replace
from mmapckpt.tools.cli import main



def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layers.{i}.w": torch.randn(4096, generator=g) for i in range(6)}


def _source(tmp_path, seed: int) -> str:
    path = str(tmp_path / f"src{seed}")
    if not os.path.exists(path):
        mmapckpt.save(_state(seed), path)
    return path


def _opts(kind: str) -> dict:
    return {"hf": {"to": "safetensors", "max_shard_size": 40_000}, "hf-single": {"to": "safetensors"}}.get(
        kind, {"to": kind})


def read(path: str) -> dict[str, torch.Tensor]:
    """The tensors at ``path`` (through any links), by mmapckpt's reader or safetensors' own."""
    if path.endswith(".safetensors"):
        return load_file(path)
    if path.endswith(".pt"):
        return torch.load(path, weights_only=True)
    return {k: v.clone() for k, v in mmapckpt.load(path).items()}


def holds(path: str, want: dict[str, torch.Tensor]) -> bool:
    got = read(path)
    return set(got) == set(want) and all(tensor_bytes(got[k]) == tensor_bytes(want[k]) for k in want)


def hidden(directory: str) -> list[str]:
    """Hidden entries (temp siblings, journals, kept trees) in ``directory``."""
    return sorted(n for n in os.listdir(directory) if n.startswith("."))


def _linked_dir(tmp_path, kind: str, how: str) -> tuple[str, str]:
    """(link, target): ``tmp_path/work/dst`` a link (absolute, relative or a chain) to a checkpoint directory."""
    real = str(tmp_path / "store" / "run1")
    os.makedirs(tmp_path / "work")
    os.makedirs(os.path.dirname(real))
    if kind == "hf-single":
        os.makedirs(real)
        convert(_source(tmp_path, 1), os.path.join(real, "model.safetensors"), to="safetensors")
    else:
        convert(_source(tmp_path, 1), real, **_opts(kind))
    add_foreign(real)
    link = str(tmp_path / "work" / "dst")
    if how == "absolute":
        os.symlink(real, link)
    elif how == "relative":
        os.symlink(os.path.join("..", "store", "run1"), link)
    else:  # a chain: dst -> hop -> ../store/run1
        os.symlink(os.path.join("..", "store", "run1"), str(tmp_path / "work" / "hop"))
        os.symlink("hop", link)
    return link, real


@pytest.mark.parametrize("how", ["absolute", "relative", "chain"])
@pytest.mark.parametrize("kind", ["mmapckpt", "dcp", "hf", "hf-single"])
def test_a_link_to_a_directory_is_kept_and_the_linked_directory_gets_the_new_checkpoint(tmp_path, kind, how):
    link, real = _linked_dir(tmp_path, kind, how)
    readlink = os.readlink(link)
    convert(_source(tmp_path, 2), link, overwrite=True, **_opts(kind))
    assert os.path.islink(link) and os.readlink(link) == readlink, "the link was replaced"
    assert os.path.realpath(link) == os.path.realpath(real)
    single = os.path.join(real, "model.safetensors")
    assert holds(single if kind == "hf-single" else real, _state(2))
    assert foreign_kept(real)
    assert hidden(str(tmp_path / "work")) == [] and hidden(str(tmp_path / "store")) == []


@pytest.mark.parametrize("kind", ["safetensors", "torch"])
def test_a_link_to_a_file_is_kept_and_the_file_it_names_is_replaced(tmp_path, kind):
    """As in a Hugging Face hub snapshot: snapshots/REV/model.safetensors -> ../../blobs/HASH."""
    blobs, snap = tmp_path / "blobs", tmp_path / "snapshots" / "rev"
    blobs.mkdir(), snap.mkdir(parents=True)
    blob = str(blobs / "0a1b2c")
    name = "model.safetensors" if kind == "safetensors" else "model.pt"
    convert(_source(tmp_path, 1), blob, to=kind)
    link = str(snap / name)
    os.symlink(os.path.join("..", "..", "blobs", "0a1b2c"), link)
    readlink = os.readlink(link)
    convert(_source(tmp_path, 2), link, to=kind, overwrite=True)
    assert os.path.islink(link) and os.readlink(link) == readlink, "the link was replaced"
    assert holds(link, _state(2))
    assert os.path.isfile(blob) and not os.path.islink(blob)
    assert sorted(os.listdir(blobs)) == ["0a1b2c"] and sorted(os.listdir(snap)) == [name]


def test_a_dangling_link_is_refused_and_left_alone(tmp_path):
    link = str(tmp_path / "dst")
    os.symlink(str(tmp_path / "nowhere"), link)
    with pytest.raises(CheckpointWriteError, match="symbolic link to .*nowhere, which does not exist"):
        convert(_source(tmp_path, 2), link, to="mmapckpt", overwrite=True)
    assert os.readlink(link) == str(tmp_path / "nowhere")
    assert sorted(os.listdir(tmp_path)) == ["dst", "src2"]


def test_without_overwrite_a_link_is_an_existing_destination(tmp_path):
    link, real = _linked_dir(tmp_path, "mmapckpt", "relative")
    with pytest.raises(CheckpointExistsError):
        convert(_source(tmp_path, 2), link, to="mmapckpt")
    assert holds(real, _state(1)) and os.path.islink(link)


def test_the_cli_keeps_the_link(tmp_path, capsys):
    link, real = _linked_dir(tmp_path, "mmapckpt", "absolute")
    assert main(["convert", _source(tmp_path, 2), link, "--to", "mmapckpt", "--overwrite", "-q"]) == 0, \
        capsys.readouterr().err
    assert os.path.islink(link) and holds(real, _state(2)) and foreign_kept(real)


_CHILD = textwrap.dedent("""
    import os, sys
    from mmapckpt.storage import replace
    from mmapckpt.tools.cli import main
    replace.EXCHANGE = False  # the fallback: the old directory renamed aside, then the new one in

    def die(*a, **k):  # the process dies between the two renames, as a SIGKILL would leave it
        os._exit(9)

    replace._rename_in = die
    sys.exit(main(sys.argv[1:]))
""")


def test_a_replacement_through_a_link_killed_midway_is_restored_through_the_link(tmp_path):
    link, real = _linked_dir(tmp_path, "mmapckpt", "relative")
    argv = ["convert", _source(tmp_path, 2), link, "--to", "mmapckpt", "--overwrite", "-q"]
    assert subprocess.run([sys.executable, "-c", _CHILD, *argv], capture_output=True, timeout=120).returncode == 9
    assert not os.path.exists(real) and os.path.islink(link)  # the old directory is aside, the link dangles
    assert os.path.isfile(replace.journal_path(real))
    with pytest.warns(ConversionWarning, match="restored the previous version"):
        convert(_source(tmp_path, 2), link, to="mmapckpt", overwrite=True)
    assert os.path.islink(link) and holds(real, _state(2)) and foreign_kept(real)
    assert hidden(str(tmp_path / "store")) == [] and hidden(str(tmp_path / "work")) == []
