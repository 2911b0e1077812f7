"""Hugging Face hub cache snapshots: files that are relative links into the repository's ``blobs/``.

``snapshot_download()`` lays a repository out as ``models--ORG--NAME/{blobs/HASH, refs/main,
snapshots/REV/...}``, every snapshot file a relative link ``../../blobs/HASH``. The directories
here are built that way (blobs named by the SHA-256 of their bytes): a sharded model with
``model.safetensors.index.json``, a single ``model.safetensors``, a model in a subfolder
(``snapshots/REV/text_encoder``) and a DCP checkpoint. Each is read through ``mmapckpt.open``,
``load``, ``load_into``, ``convert`` and the CLI's ``inspect`` and ``verify``, bitwise. Links that
leave the repository's ``blobs/`` (out of the cache, by ``..``, absolute, into another
repository's blobs, into ``refs/``) are refused with UnsafePathError by every one of them.
"""

from __future__ import annotations

import hashlib
import os
import shutil

import pytest
import torch
from helpers import tensor_bytes

import mmapckpt
from mmapckpt import CheckpointError, UnsafePathError, convert
from mmapckpt.tools.cli import main


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    sd = {f"model.layers.{i}.w": torch.randn(64, 32, generator=g) for i in range(5)}
    sd["model.embed"] = torch.randn(100, 16, generator=g).to(torch.bfloat16)
    sd["lm_head.bias"] = torch.arange(10, dtype=torch.int32)
    return sd


def _files(tmp_path, kind: str) -> dict[str, bytes]:
    """The files of a checkpoint of ``kind`` (relative name -> bytes), written by save/convert elsewhere."""
    where = str(tmp_path / f"made-{kind}")
    src = str(tmp_path / "made-src")
    if not os.path.exists(src):
        mmapckpt.save(_state(), src)
    if kind == "dcp":
        mmapckpt.save(_state(), where, thread_count=2)  # two shard files
    elif kind == "sharded":
        convert(src, where, to="safetensors", max_shard_size=20_000)
    else:
        os.makedirs(where)
        convert(src, os.path.join(where, "model.safetensors"), to="safetensors")
    out = {}
    for name in os.listdir(where):
        with open(os.path.join(where, name), "rb") as f:
            out[name] = f.read()
    out["config.json"] = b'{"model_type": "llama"}'
    return out


def hub_repo(cache: str, repo: str, files: dict[str, bytes], rev: str = "0123abcd", sub: str = "") -> str:
    """``cache/models--repo`` laid out as the hub lays it out; returns the snapshot directory (or its ``sub``)."""
    root = os.path.join(cache, f"models--{repo}")
    blobs, snap = os.path.join(root, "blobs"), os.path.normpath(os.path.join(root, "snapshots", rev, sub))
    os.makedirs(blobs, exist_ok=True)
    os.makedirs(snap, exist_ok=True)
    os.makedirs(os.path.join(root, "refs"), exist_ok=True)
    with open(os.path.join(root, "refs", "main"), "w") as f:
        f.write(rev)
    for name, data in files.items():
        blob = os.path.join(blobs, hashlib.sha256(data).hexdigest())
        with open(blob, "wb") as f:
            f.write(data)
        link = os.path.join(snap, name)
        os.symlink(os.path.relpath(blob, os.path.dirname(link)), link)  # ../../blobs/HASH
    return snap


def _equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and tensor_bytes(got[k]) == tensor_bytes(want[k]), k


def _read_everywhere(path: str, tmp_path, capsys) -> None:
    """Every entry point reads ``path`` bitwise."""
    want = _state()
    with mmapckpt.open(path) as f:
        _equal({k: f.get_tensor(k) for k in f.keys()}, want)
    _equal(mmapckpt.load(path), want)
    targets = {k: torch.zeros_like(v) for k, v in want.items()}
    mmapckpt.load_into(targets, path)
    _equal(targets, want)
    out = str(tmp_path / "converted")
    convert(path, out, to="mmapckpt")
    _equal(mmapckpt.load(out), want)
    capsys.readouterr()
    assert main(["inspect", path]) == 0, capsys.readouterr().err
    assert "model.layers.0.w" in capsys.readouterr().out
    assert main(["verify", path]) == 0, capsys.readouterr()
    assert "sound" in capsys.readouterr().out


@pytest.mark.parametrize("kind", ["sharded", "single", "dcp"])
def test_a_snapshot_reads_through_its_blob_links(tmp_path, capsys, kind):
    from mmapckpt.storage.hub import hub_blobs

    snap = hub_repo(str(tmp_path / "hub"), "org--model", _files(tmp_path, kind))
    assert all(os.path.islink(os.path.join(snap, n)) for n in os.listdir(snap))
    assert hub_blobs(os.path.realpath(snap)) == os.path.realpath(os.path.join(snap, "..", "..", "blobs"))
    _read_everywhere(snap, tmp_path, capsys)


def test_a_model_in_a_subfolder_of_a_snapshot_reads_through_its_blob_links(tmp_path, capsys):
    snap = hub_repo(str(tmp_path / "hub"), "org--pipeline", _files(tmp_path, "sharded"), sub="text_encoder")
    assert os.readlink(os.path.join(snap, "config.json")).startswith(os.path.join("..", "..", "..", "blobs"))
    _read_everywhere(snap, tmp_path, capsys)


# --------------------------------------------------------------------------- hostile links
HOSTILE = ["out of the cache", "via .. through blobs", "absolute out", "another repo's blob", "refs of this repo"]


def _hostile_target(tmp_path, cache: str, snap: str, hostile: str, data: bytes) -> str:
    """Where a hostile link in ``snap`` (``models--org--model/snapshots/REV``) points; a file holding ``data`` is there."""
    outside = tmp_path / "outside" / "model.safetensors"
    outside.parent.mkdir(exist_ok=True)
    outside.write_bytes(data)
    if hostile == "out of the cache":
        return os.path.relpath(str(outside), snap)  # ../../../../outside/model.safetensors
    if hostile == "via .. through blobs":  # ../../blobs/../../../outside/model.safetensors
        return os.path.join("..", "..", "blobs", "..", "..", "..", os.path.relpath(str(outside), str(tmp_path)))
    if hostile == "absolute out":
        return str(outside)
    if hostile == "another repo's blob":
        other = hub_repo(cache, "evil--other", {"model.safetensors": data})
        return os.path.relpath(os.path.realpath(os.path.join(other, "model.safetensors")), snap)
    repo = os.path.dirname(os.path.dirname(snap))
    with open(os.path.join(repo, "refs", "stash"), "wb") as f:
        f.write(data)
    return os.path.join("..", "..", "refs", "stash")


def _refused_everywhere(path: str, tmp_path, capsys) -> None:
    with pytest.raises(UnsafePathError):
        mmapckpt.open(path)
    with pytest.raises(UnsafePathError):
        mmapckpt.load(path)
    with pytest.raises(UnsafePathError):
        mmapckpt.load_into({k: torch.zeros_like(v) for k, v in _state().items()}, path)
    with pytest.raises(UnsafePathError):
        convert(path, str(tmp_path / "never"), to="mmapckpt")
    assert not os.path.exists(tmp_path / "never")
    capsys.readouterr()
    assert main(["inspect", path]) == 1
    assert "outside the checkpoint directory" in capsys.readouterr().err
    assert main(["verify", path]) == 1
    assert "outside the checkpoint directory" in capsys.readouterr().out


@pytest.mark.parametrize("hostile", HOSTILE)
@pytest.mark.parametrize("which", ["a shard", "model.safetensors", "the index"])
def test_links_that_leave_the_repositorys_blobs_are_refused(tmp_path, capsys, which, hostile):
    cache = str(tmp_path / "hub")
    files = _files(tmp_path, "single" if which == "model.safetensors" else "sharded")
    snap = hub_repo(cache, "org--model", files)
    name = {"model.safetensors": "model.safetensors", "the index": "model.safetensors.index.json"}.get(which) or \
        sorted(n for n in files if n.startswith("model-"))[0]
    target = _hostile_target(tmp_path, cache, snap, hostile, files[name])  # a copy of the genuine file
    if which == "the index":  # the shards as plain files: only the index's link can be refused
        for shard in (n for n in files if n.startswith("model-")):
            os.unlink(os.path.join(snap, shard))
            with open(os.path.join(snap, shard), "wb") as f:
                f.write(files[shard])
    link = os.path.join(snap, name)
    os.unlink(link)
    os.symlink(target, link)
    with open(link, "rb") as f:
        assert f.read() == files[name]  # the link works: only the rule stands between the reader and it
    _refused_everywhere(snap, tmp_path, capsys)


def test_an_index_naming_a_blob_by_a_path_that_leaves_the_snapshot_is_refused(tmp_path, capsys):
    """Only links are followed into blobs/: a weight_map entry ``../../blobs/HASH`` is itself a path out."""
    files = _files(tmp_path, "sharded")
    snap = hub_repo(str(tmp_path / "hub"), "org--model", files)
    shard = sorted(n for n in files if n.startswith("model-"))[0]
    blob = os.path.realpath(os.path.join(snap, shard))
    index = os.path.join(snap, "model.safetensors.index.json")
    text = open(index).read()
    assert f'"{shard}"' in text
    text = text.replace(f'"{shard}"', f'"{os.path.relpath(blob, snap)}"')  # ../../blobs/HASH
    os.unlink(index)
    with open(index, "w") as f:
        f.write(text)
    _refused_everywhere(snap, tmp_path, capsys)


@pytest.mark.parametrize("layout", ["no snapshots parent", "not a hub repository name", "blobs is a link"])
def test_the_rule_needs_the_hub_layout(tmp_path, capsys, layout):
    """blobs/ links are followed only in models--ORG--NAME/snapshots/REV with a real blobs/ beside snapshots/."""
    files = _files(tmp_path, "sharded")
    snap = hub_repo(str(tmp_path / "hub"), "org--model", files)
    repo = os.path.dirname(os.path.dirname(snap))
    if layout == "no snapshots parent":  # the same links one level up: blobs/ is no sibling of snapshots/
        moved = os.path.join(repo, "plain")
        os.makedirs(moved)
        for n in os.listdir(snap):
            os.symlink(os.path.join("..", "blobs", os.path.basename(os.readlink(os.path.join(snap, n)))),
                       os.path.join(moved, n))
        snap = moved
    elif layout == "not a hub repository name":
        renamed = os.path.join(os.path.dirname(repo), "org--model")
        os.rename(repo, renamed)
        snap = os.path.join(renamed, "snapshots", os.path.basename(snap))
    else:  # blobs/ itself a link to the real blobs elsewhere
        real = str(tmp_path / "elsewhere-blobs")
        shutil.move(os.path.join(repo, "blobs"), real)
        os.symlink(real, os.path.join(repo, "blobs"))
    assert os.path.isfile(os.path.join(snap, "model.safetensors.index.json"))  # every link works
    _refused_everywhere(snap, tmp_path, capsys)


def test_a_dcp_snapshot_refuses_a_shard_linked_to_another_repositorys_blob(tmp_path, capsys):
    files = _files(tmp_path, "dcp")
    cache = str(tmp_path / "hub")
    snap = hub_repo(cache, "org--model", files)
    shard = sorted(n for n in files if n.endswith(".distcp"))[0]
    other = hub_repo(cache, "evil--other", {shard: files[shard]})
    link = os.path.join(snap, shard)
    os.unlink(link)
    os.symlink(os.path.relpath(os.path.realpath(os.path.join(other, shard)), snap), link)
    with pytest.raises(UnsafePathError):
        mmapckpt.load(snap)
    with pytest.raises(CheckpointError):
        convert(snap, str(tmp_path / "never"), to="safetensors")


@pytest.mark.parametrize("kind", ["sharded", "dcp"])
def test_mmapreader_reads_a_repository_root_as_its_snapshot(tmp_path, kind):
    """``MmapReader(models--ORG--NAME)`` reads the snapshot ``refs/main`` names, as ``open``/``load`` do."""
    import torch.distributed.checkpoint as dcp

    snap = hub_repo(str(tmp_path / "hub"), "org--model", _files(tmp_path, kind))
    root = os.path.dirname(os.path.dirname(snap))
    want = _state()
    _equal(mmapckpt.load(root), want)
    targets = {k: torch.zeros_like(v) for k, v in want.items()}
    dcp.load(targets, storage_reader=mmapckpt.MmapReader(root), no_dist=True)
    _equal(targets, want)
