"""Hugging Face directories of ``torch.save`` files: ``pytorch_model.bin``, or ``pytorch_model-0000X-of-0000N.bin``
shards with ``pytorch_model.bin.index.json``, as a directory and as a hub cache snapshot (and its repository root).

The directories are written by ``huggingface_hub.save_torch_state_dict(..., safe_serialization=False)`` (the code
that shards and names them; transformers 5 writes safetensors only, whatever ``safe_serialization`` says) from
the state dict of a tiny Llama built from a ``LlamaConfig``, and compared byte for byte with ``torch.load`` of
the same files; ``transformers`` itself loads them too. Every reader (``open``, ``load``, ``load_into``,
``convert``, ``inspect``) reads them, and a damaged index fails naming the file and the entry. The hub cache
is built by hand as ``snapshot_download`` lays it out and checked with huggingface_hub's own offline readers.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil

import pytest
import torch
from helpers import assert_bitwise_equal
from unmapped import medium, url  # noqa: F401  (medium: the unmapped:// fixture)

import mmapckpt
from mmapckpt import CheckpointError, CheckpointNotFoundError, FormatError, UnsafePathError, convert
from mmapckpt.tools.cli import main

transformers = pytest.importorskip("transformers")
hub = pytest.importorskip("huggingface_hub")

SHARD = 40_000  # bytes: the tiny Llama below (~0.2 MB) makes several shards


def _model() -> torch.nn.Module:
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():  # the values the format must carry unchanged: -0.0, a NaN payload, bf16
        w = model.model.layers[0].mlp.up_proj.weight
        w[0, 0] = -0.0
        w.view(torch.int32)[0, 1] = 0x7FC0_1234
    model.model.norm.to(torch.bfloat16)
    return model


def _write(model: torch.nn.Module, out: str, max_shard_size: int | str) -> str:
    os.makedirs(out)
    logging.getLogger("huggingface_hub").setLevel(logging.ERROR)  # its "unsafe serialization" warning
    hub.save_torch_state_dict(model.state_dict(), out, safe_serialization=False, max_shard_size=max_shard_size)
    model.config.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("hfbin")
    model = _model()
    return {"single": _write(model, str(root / "single"), "10GB"),
            "sharded": _write(model, str(root / "sharded"), SHARD)}


def _torch_load(d: str) -> dict[str, torch.Tensor]:
    """What the files hold, read by torch.load (each file in turn, as transformers reads them)."""
    out: dict[str, torch.Tensor] = {}
    for name in sorted(os.listdir(d)):
        if name.endswith(".bin"):
            out.update(torch.load(os.path.join(d, name), weights_only=True))
    return out


def _equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for k in want:
        assert_bitwise_equal(got[k], want[k], k)


def test_the_layouts_are_the_real_ones(dirs) -> None:
    assert sorted(os.listdir(dirs["single"])) == ["config.json", "pytorch_model.bin"]
    names = sorted(os.listdir(dirs["sharded"]))
    shards = [n for n in names if n.endswith(".bin")]
    assert len(shards) >= 3 and shards[0] == f"pytorch_model-00001-of-{len(shards):05d}.bin"
    assert "pytorch_model.bin.index.json" in names
    want = _torch_load(dirs["single"])
    _equal(_torch_load(dirs["sharded"]), want)
    assert want["model.norm.weight"].dtype == torch.bfloat16 and "lm_head.weight" in want  # tied: both saved


@pytest.mark.parametrize("layout", ["single", "sharded"])
def test_open_load_load_into_bitwise_against_torch_load(dirs, layout) -> None:
    d, want = dirs[layout], _torch_load(dirs[layout])
    with mmapckpt.open(d) as f:
        assert f.kind == "torch" and sorted(f.keys()) == sorted(want)
        for k in want:
            assert_bitwise_equal(f.get_tensor(k), want[k], k)
        assert_bitwise_equal(f.get_slice("model.embed_tokens.weight")[3:7, ::2],
                             want["model.embed_tokens.weight"][3:7, ::2])
    _equal(mmapckpt.load(d), want)
    _equal(mmapckpt.load(d, keys=["lm_head.weight"]), {"lm_head.weight": want["lm_head.weight"]})
    targets = {k: torch.zeros_like(v) for k, v in want.items()}
    mmapckpt.load_into(targets, d)
    _equal(targets, want)


def test_transformers_loads_the_same_values(dirs) -> None:
    """The directory is what transformers reads: from_pretrained on it gives what mmapckpt.load gives."""
    for layout in ("single", "sharded"):
        model = transformers.LlamaForCausalLM.from_pretrained(dirs[layout])
        got = mmapckpt.load(dirs[layout])
        for k, v in model.state_dict().items():
            assert_bitwise_equal(got[k].to(v.dtype), v, k)  # from_pretrained casts to the config's dtype


@pytest.mark.parametrize("to", ["safetensors", "mmapckpt", "dcp"])
def test_convert_and_back_bitwise(dirs, tmp_path, to) -> None:
    want = _torch_load(dirs["sharded"])
    mid = str(tmp_path / "mid")
    convert(dirs["sharded"], mid, to=to, max_shard_size=SHARD if to == "safetensors" else None)
    _equal(mmapckpt.load(mid), want)
    back = str(tmp_path / "back.pt")
    convert(mid, back, to="torch")
    _equal(torch.load(back, weights_only=True), want)
    direct = str(tmp_path / "direct.pt")
    convert(dirs["single"], direct, to="torch")
    _equal(torch.load(direct, weights_only=True), want)


@pytest.mark.parametrize("layout", ["single", "sharded"])
def test_at_a_url(dirs, medium, tmp_path, layout) -> None:  # noqa: F811
    """On a medium without mappings (an object store's prefix) each shard is read whole through the storage."""
    u, want = url(dirs[layout]), _torch_load(dirs[layout])
    with mmapckpt.open(u) as f:
        assert f.kind == "torch"
        _equal({k: f.get_tensor(k) for k in f.keys()}, want)
    _equal(mmapckpt.load(u), want)
    assert medium[0] >= sum(os.path.getsize(os.path.join(dirs[layout], n)) for n in os.listdir(dirs[layout])
                            if n.endswith(".bin"))
    out = str(tmp_path / "out")
    convert(u, out, to="mmapckpt")
    _equal(mmapckpt.load(out), want)


def test_inspect_names_the_layout(dirs, capsys) -> None:
    capsys.readouterr()
    assert main(["inspect", dirs["sharded"]]) == 0
    out = capsys.readouterr().out
    n = len([x for x in os.listdir(dirs["sharded"]) if x.endswith(".bin")])
    assert f"torch (torch.save zip archive: {n} shards with index)" in out and "lm_head.weight" in out
    assert main(["inspect", dirs["single"]]) == 0
    assert "pytorch_model.bin in a directory" in capsys.readouterr().out


def test_safetensors_weights_win_where_both_are_there(dirs, tmp_path) -> None:
    """As transformers picks them: a directory with model.safetensors and pytorch_model.bin reads the former."""
    d = str(tmp_path / "both")
    shutil.copytree(dirs["single"], d)
    import safetensors.torch
    safetensors.torch.save_file({"only.here": torch.ones(3)}, os.path.join(d, "model.safetensors"))
    with mmapckpt.open(d) as f:
        assert f.kind == "safetensors" and list(f.keys()) == ["only.here"]


# --------------------------------------------------------------------------- damaged indexes
def _copy(dirs, tmp_path, name: str = "d") -> tuple[str, dict, list[str]]:
    d = str(tmp_path / name)
    shutil.copytree(dirs["sharded"], d)
    with open(os.path.join(d, "pytorch_model.bin.index.json")) as f:
        index = json.load(f)
    return d, index, sorted(set(index["weight_map"].values()))


def _rewrite_index(d: str, index: dict | str) -> None:
    with open(os.path.join(d, "pytorch_model.bin.index.json"), "w") as f:
        f.write(index if isinstance(index, str) else json.dumps(index))


def _everywhere_raises(d: str, error: type[Exception], match: str, tmp_path) -> CheckpointError:
    with pytest.raises(error, match=match) as ei:
        mmapckpt.open(d)
    with pytest.raises(error, match=match):
        mmapckpt.load(d)
    with pytest.raises(error, match=match):
        mmapckpt.load_into({"lm_head.weight": torch.zeros(128, 32)}, d)
    with pytest.raises(error, match=match):
        convert(d, str(tmp_path / "never"), to="mmapckpt")
    assert not os.path.exists(tmp_path / "never")
    return ei.value


def test_a_shard_the_index_names_is_missing(dirs, tmp_path) -> None:
    d, index, shards = _copy(dirs, tmp_path)
    os.unlink(os.path.join(d, shards[-1]))
    e = _everywhere_raises(d, CheckpointError, "named in the index is missing", tmp_path)
    assert e.path == os.path.join(d, shards[-1]) and index["weight_map"][e.entry] == shards[-1]


def test_a_name_the_index_puts_in_a_shard_that_lacks_it(dirs, tmp_path) -> None:
    d, index, shards = _copy(dirs, tmp_path)
    index["weight_map"]["model.ghost"] = shards[0]
    _rewrite_index(d, index)
    e = _everywhere_raises(d, FormatError, "the file lacks it", tmp_path)
    assert e.path == os.path.join(d, shards[0]) and e.entry == "model.ghost"


def test_a_shard_the_index_never_names(dirs, tmp_path) -> None:
    d, index, shards = _copy(dirs, tmp_path)
    last = shards[-1]
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != last}
    _rewrite_index(d, index)
    e = _everywhere_raises(d, CheckpointError, "index never names", tmp_path)
    assert e.path == os.path.join(d, last)
    # a shard of another series (another count, or a tagged name) is another checkpoint's leftover (an
    # interrupted conversion's): it is left alone, as the index's own files are read
    d, index, shards = _copy(dirs, tmp_path, "leftovers")
    n = len(shards)
    for other in (f"pytorch_model-00001-of-{n + 1:05d}.bin", f"pytorch_model-00001-of-{n:05d}.0a1b2c3d.bin"):
        shutil.copy(os.path.join(d, shards[0]), os.path.join(d, other))
    _equal(mmapckpt.load(d), _torch_load(dirs["sharded"]))


def test_a_name_twice_in_the_index_and_other_damage(dirs, tmp_path) -> None:
    d, index, shards = _copy(dirs, tmp_path)
    first = next(iter(index["weight_map"]))
    text = json.dumps(index)
    _rewrite_index(d, text.replace('"weight_map": {', f'"weight_map": {{"{first}": "{shards[-1]}", ', 1))
    e = _everywhere_raises(d, FormatError, "appears twice", tmp_path)
    assert e.path == os.path.join(d, "pytorch_model.bin.index.json") and first in str(e)
    _rewrite_index(d, '{"weight_map": ["a.bin"]}')
    _everywhere_raises(d, FormatError, "weight_map", tmp_path)
    _rewrite_index(d, "{not json")
    _everywhere_raises(d, FormatError, "unreadable index", tmp_path)


def test_a_shard_out_of_the_directory_is_refused(dirs, tmp_path) -> None:
    d, index, shards = _copy(dirs, tmp_path)
    outside = str(tmp_path / "outside.bin")
    shutil.copy(os.path.join(d, shards[0]), outside)
    index["weight_map"] = {k: ("../outside.bin" if v == shards[0] else v) for k, v in index["weight_map"].items()}
    _rewrite_index(d, index)
    _everywhere_raises(d, UnsafePathError, "outside the checkpoint directory", tmp_path)
    d2, index, shards = _copy(dirs, tmp_path, "linked")  # a link out, under the name the index gives
    os.unlink(os.path.join(d2, shards[0]))
    os.symlink(outside, os.path.join(d2, shards[0]))
    _everywhere_raises(d2, UnsafePathError, "outside the checkpoint directory", tmp_path)


class _Evil:
    def __reduce__(self):  # runs a command when unpickled without weights_only
        return (os.system, ("touch /tmp/mmapckpt-pwned",))


def test_a_shard_that_is_unsafe_or_no_state_dict(dirs, tmp_path) -> None:
    d, index, shards = _copy(dirs, tmp_path)
    path = os.path.join(d, shards[1])
    keep = torch.load(path, weights_only=True)
    keep[next(iter(keep))] = _Evil()
    torch.save(keep, path)
    e = _everywhere_raises(d, FormatError, "weights_only", tmp_path)
    assert e.path == path
    torch.save([1, 2], path)
    _everywhere_raises(d, FormatError, "not a state dict", tmp_path)


# --------------------------------------------------------------------------- hub cache
def _hub(cache: str, repo_id: str, src: str, rev: str) -> str:
    """``cache`` laid out as ``snapshot_download`` leaves ``repo_id`` at commit ``rev`` with the files of ``src``:
    blobs named by their SHA-256, snapshot files relative links to them, refs/main holding ``rev``."""
    repo = os.path.join(cache, "models--" + repo_id.replace("/", "--"))
    snap = os.path.join(repo, "snapshots", rev)
    for d in (os.path.join(repo, "blobs"), os.path.join(repo, "refs"), snap):
        os.makedirs(d, exist_ok=True)
    with open(os.path.join(repo, "refs", "main"), "w") as f:
        f.write(rev)
    for name in os.listdir(src):
        with open(os.path.join(src, name), "rb") as f:
            data = f.read()
        blob = os.path.join(repo, "blobs", hashlib.sha256(data).hexdigest())
        with open(blob, "wb") as f:
            f.write(data)
        os.symlink(os.path.join("..", "..", "blobs", os.path.basename(blob)), os.path.join(snap, name))
    return repo


@pytest.mark.parametrize("layout", ["single", "sharded"])
def test_a_hub_cache_snapshot_and_its_repository_root(dirs, tmp_path, layout) -> None:
    cache, rev = str(tmp_path / "hub"), "a" * 40
    repo = _hub(cache, "org/tiny-llama", dirs[layout], rev)
    snap = os.path.join(repo, "snapshots", rev)
    # huggingface_hub's own offline readers find the same snapshot and files
    assert hub.snapshot_download("org/tiny-llama", cache_dir=cache, local_files_only=True) == snap
    info = hub.scan_cache_dir(cache)
    assert not info.warnings and [r.repo_id for r in info.repos] == ["org/tiny-llama"]
    assert hub.try_to_load_from_cache("org/tiny-llama", "config.json", cache_dir=cache) == \
        os.path.join(snap, "config.json")
    want = _torch_load(dirs[layout])
    for path in (snap, repo):
        with mmapckpt.open(path) as f:
            assert f.kind == "torch"
            _equal({k: f.get_tensor(k) for k in f.keys()}, want)
        _equal(mmapckpt.load(path), want)
        targets = {k: torch.zeros_like(v) for k, v in want.items()}
        mmapckpt.load_into(targets, path)
        _equal(targets, want)
        out = str(tmp_path / f"out-{os.path.basename(path)}")
        convert(path, out, to="mmapckpt")
        _equal(mmapckpt.load(out), want)
    assert all(os.path.islink(os.path.join(snap, n)) for n in os.listdir(snap))
    assert len(os.listdir(os.path.join(repo, "blobs"))) == len(os.listdir(dirs[layout]))


def test_a_hub_snapshot_shard_linked_out_of_its_blobs_is_refused(dirs, tmp_path) -> None:
    cache, rev = str(tmp_path / "hub"), "b" * 40
    repo = _hub(cache, "org/tiny-llama", dirs["sharded"], rev)
    snap = os.path.join(repo, "snapshots", rev)
    shard = sorted(n for n in os.listdir(snap) if n.endswith(".bin"))[0]
    outside = str(tmp_path / "elsewhere.bin")
    shutil.copy(os.path.join(snap, shard), outside)
    os.unlink(os.path.join(snap, shard))
    os.symlink(outside, os.path.join(snap, shard))
    for path in (snap, repo):
        _everywhere_raises(path, UnsafePathError, "outside the checkpoint directory", tmp_path)


def test_a_hub_repository_root_without_its_snapshot(dirs, tmp_path) -> None:
    cache, rev = str(tmp_path / "hub"), "c" * 40
    repo = _hub(cache, "org/tiny-llama", dirs["single"], rev)
    with open(os.path.join(repo, "refs", "main"), "w") as f:
        f.write("d" * 40)  # a revision not downloaded
    with pytest.raises(CheckpointNotFoundError, match="no snapshot here") as ei:
        mmapckpt.load(repo)
    assert rev in str(ei.value)  # says which snapshots are there to name instead
    shutil.copytree(dirs["single"], os.path.join(cache, "elsewhere"))  # a model a path out of snapshots/ reaches
    for rev in ("../../elsewhere", os.path.join(cache, "elsewhere")):
        with open(os.path.join(repo, "refs", "main"), "w") as f:
            f.write(rev)
        with pytest.raises(CheckpointNotFoundError, match="no snapshot here"):
            convert(repo, str(tmp_path / "never"), to="mmapckpt")
        assert not os.path.exists(tmp_path / "never")
    os.unlink(os.path.join(repo, "refs", "main"))
    with pytest.raises(CheckpointNotFoundError, match="refs/main"):
        mmapckpt.open(repo)


def test_the_same_rules_for_safetensors_directories(dirs, tmp_path) -> None:
    """The index code is shared: a hub repository root of safetensors files reads; an unnamed shard is refused."""
    sharded = str(tmp_path / "st")
    convert(dirs["sharded"], sharded, to="safetensors", max_shard_size=SHARD)
    want = _torch_load(dirs["sharded"])
    repo = _hub(str(tmp_path / "hub"), "org/tiny-llama-st", sharded, "e" * 40)
    _equal(mmapckpt.load(repo), want)
    with open(os.path.join(sharded, "model.safetensors.index.json")) as f:
        index = json.load(f)
    last = sorted(set(index["weight_map"].values()))[-1]
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != last}
    os.unlink(os.path.join(sharded, "model.safetensors.index.json"))
    with open(os.path.join(sharded, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f)
    e = _everywhere_raises(sharded, CheckpointError, "index never names", tmp_path)
    assert e.path == os.path.join(sharded, last)
