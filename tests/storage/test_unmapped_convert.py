"""``convert``, ``inspect`` and ``verify`` at URLs: the medium without mappings (tests/unmapped.py) as source and
destination.

Every format pair converted from a URL, to a URL and from one to another gives tensors bitwise
equal to the local conversion's (bf16, NaN payloads, -0.0, empty tensors, chunks out of order and
split along columns), safetensors files byte for byte. A destination at a URL is written through
the storage (conversion/to_url.py): a failed conversion leaves the old checkpoint whole and
nothing of its own behind, an overwrite removes the old checkpoint's files and no other, and the
CLI takes URLs as it takes paths.
"""

from __future__ import annotations

import errno
import os
import warnings
from typing import Any

import pytest
import torch
from helpers import FOREIGN, add_foreign, foreign_kept, save_chunked, tensor_bytes
from safetensors.torch import save_file
from unmapped import Unmapped, url

import mmapckpt
from mmapckpt import CheckpointError, CheckpointExistsError, CheckpointWriteError, convert
from mmapckpt.reading.shard import Shard
from mmapckpt.storage import location
from mmapckpt.storage.base import FileOutput
from mmapckpt.tools.cli import main

TARGETS = {"mmapckpt": ("mmapckpt", {}), "dcp": ("dcp", {}), "safetensors": ("safetensors", {}),
           "hf": ("safetensors", {"max_shard_size": 2500}), "torch": ("torch", {})}


def state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    nan32 = torch.tensor([0x7FC00001, 0x7F800123, -0x3FFFFF, 0], dtype=torch.int32).view(torch.float32)
    nan16 = torch.tensor([0x7FC1, -0x3F, 0x7F81, -0x8000], dtype=torch.int16).view(torch.bfloat16)
    return {"a.weight": torch.randn(24, 40, generator=g).to(torch.bfloat16), "b.nan": nan32, "b.bfnan": nan16,
            "c.zero": torch.tensor([-0.0, 0.0, -0.0], dtype=torch.float64),
            "d.rows": torch.arange(600, dtype=torch.int64).reshape(12, 50),
            "d.cols": torch.randn(6, 10, generator=g), "e.empty": torch.empty(0, 7),
            "f.scalar": torch.tensor(2.5, dtype=torch.float16)}


def sources(root: str) -> dict[str, str]:
    """A checkpoint of each format (local paths), holding :func:`state`."""
    sd = state()
    out = {"mmapckpt": os.path.join(root, "src-mmapckpt"), "dcp": os.path.join(root, "src-dcp"),
           "safetensors": os.path.join(root, "src.safetensors"), "hf": os.path.join(root, "src-hf"),
           "torch": os.path.join(root, "src.pt")}
    layouts = {"d.rows": [((6, 0), (6, 50)), ((0, 0), (6, 50))],  # row runs, listed out of order
               "d.cols": [((0, 5), (6, 5)), ((0, 0), (6, 5))]}  # split along columns: gathered
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        save_chunked(sd, layouts, mmapckpt.MmapWriter(out["mmapckpt"], thread_count=2))
        save_chunked(sd, layouts, torch.distributed.checkpoint.FileSystemWriter(out["dcp"]))
    save_file(sd, out["safetensors"])
    convert(out["safetensors"], out["hf"], to="safetensors", max_shard_size=2500)
    torch.save(sd, out["torch"])
    return out


def _tensors(path: str) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in mmapckpt.load(path).items()}


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: Any) -> None:
    assert sorted(got) == sorted(want), what
    for k, v in want.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, (what, k)
        assert tensor_bytes(got[k]) == tensor_bytes(v), (what, k)


def _files(path: str) -> dict[str, bytes]:
    if os.path.isfile(path):
        return {"": open(path, "rb").read()}
    return {n: open(os.path.join(path, n), "rb").read() for n in sorted(os.listdir(path))}


def _dst(root: str, name: str, how: str) -> str:
    return os.path.join(root, f"{how}-{name}" + {"safetensors": ".safetensors", "torch": ".pt"}.get(name, ""))


@pytest.mark.parametrize("src_kind", list(TARGETS)[:2] + ["safetensors", "hf", "torch"])
def test_every_format_pair_converts_from_and_to_urls_bitwise(medium, tmp_path, src_kind) -> None:
    srcs = sources(str(tmp_path))
    src = srcs[src_kind]
    want = state()
    for name, (to, opts) in TARGETS.items():
        out = {how: _dst(str(tmp_path), name, how) for how in ("local", "from", "to", "both")}
        local = convert(src, out["local"], to=to, **opts)
        results = [convert(url(src), out["from"], to=to, **opts),
                   convert(src, url(out["to"]), to=to, **opts),
                   convert(url(src), url(out["both"]), to=to, **opts)]
        for r in results:
            assert (r.source_format, r.target_format, r.tensors, r.tensor_bytes, r.dropped) == \
                (local.source_format, local.target_format, local.tensors, local.tensor_bytes, local.dropped)
        base = _tensors(out["local"])
        _assert_same(base, want, (src_kind, name))
        for how in ("from", "to", "both"):
            _assert_same(_tensors(out[how]), base, (src_kind, name, how))
            _assert_same(_tensors(url(out[how])), base, (src_kind, name, how, "read at the url"))
            assert sorted(_files(out[how])) == sorted(_files(out["local"])), (src_kind, name, how)  # the same files
            if to == "safetensors":  # deterministic bytes: the same files, byte for byte
                assert _files(out[how]) == _files(out["local"]), (src_kind, name, how)


# --------------------------------------------------------------------------- a medium that fails when told
class _FailingOutput(FileOutput):
    def __init__(self, inner: FileOutput) -> None:
        self.inner, self.path, self.how = inner, inner.path, inner.how

    def put(self, offset: int, data: Any) -> None:
        n = memoryview(data).nbytes
        if Failing.budget[0] is not None:
            if n > Failing.budget[0]:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            Failing.budget[0] -= n
        self.inner.put(offset, data)

    def finish(self, head: bytes) -> None:
        self.inner.finish(head)
        Failing.finished.append(os.path.basename(self.path))

    def abort(self) -> None:
        self.inner.abort()


class Failing(Unmapped):
    """The medium, whose writes fail past ``budget`` bytes (None: never) and whose commits fail if told."""

    budget: list[int | None] = [None]
    fail_commit = [False]
    finished: list[str] = []

    def create_file(self, name: str, size: int | None, *, head: int, direct: bool, sync: bool) -> FileOutput:
        return _FailingOutput(super().create_file(name, size, head=head, direct=direct, sync=sync))

    def commit(self, name: str, data: bytes, *, sync: bool) -> None:
        if Failing.fail_commit[0]:
            raise CheckpointWriteError(f"committing the metadata failed: {os.strerror(errno.ENOSPC)}",
                                       path=self.full(name))
        super().commit(name, data, sync=sync)


@pytest.fixture
def failing(medium):
    location.register_scheme("unmapped", Failing)
    Failing.budget[0], Failing.fail_commit[0] = None, False
    Failing.finished.clear()
    yield Failing


def _listing(d: str) -> dict[str, bytes]:
    return {n: open(os.path.join(d, n), "rb").read() for n in sorted(os.listdir(d))}


@pytest.mark.parametrize("name", list(TARGETS))
def test_a_failed_conversion_to_a_url_leaves_the_old_checkpoint_and_nothing_of_its_own(failing, tmp_path, name):
    srcs = sources(str(tmp_path))
    to, opts = TARGETS[name]
    old_src = str(tmp_path / "old.safetensors")
    save_file({"old": torch.arange(700, dtype=torch.float32)}, old_src)
    if name == "hf":  # old shards of the usual names of the new ones: the new ones take other names
        old_src = str(tmp_path / "old.pt")
        torch.save({k: v + 1 if v.is_floating_point() else v for k, v in state().items()}, old_src)
    dst = _dst(str(tmp_path), name, "dst")
    convert(old_src, url(dst), to=to, **opts)
    if os.path.isdir(dst):
        add_foreign(dst)
    old, before = _tensors(dst), _files(dst)
    for cut in ("put", "commit"):
        Failing.budget[0], Failing.fail_commit[0] = (1000, False) if cut == "put" else (None, True)
        if cut == "commit" and to in ("safetensors", "torch") and "max_shard_size" not in opts:
            continue  # a single file has no commit: its FileOutput is the one step
        with pytest.raises(CheckpointWriteError) as info:
            convert(srcs["mmapckpt"], url(dst), to=to, overwrite=True, **opts)
        msg = str(info.value)
        assert os.strerror(errno.ENOSPC) in msg and url(dst) in msg, msg
        assert "was left as it was" in msg, msg
        assert _files(dst) == before, (name, cut)  # the old checkpoint untouched, nothing left beside it
        _assert_same(_tensors(dst), old, (name, cut))
    Failing.budget[0], Failing.fail_commit[0] = None, False
    convert(srcs["mmapckpt"], url(dst), to=to, overwrite=True, **opts)  # and then it works
    _assert_same(_tensors(dst), state(), name)


def test_a_failed_conversion_leaves_old_hugging_face_shards_of_other_names(failing, tmp_path) -> None:
    srcs = sources(str(tmp_path))
    dst = str(tmp_path / "hf")
    save_file({"old": torch.arange(700, dtype=torch.float32)}, str(tmp_path / "old.safetensors"))
    convert(str(tmp_path / "old.safetensors"), url(dst), to="safetensors", max_shard_size=2500)
    before = _files(dst)
    assert list(before) == ["model-00001-of-00001.safetensors", "model.safetensors.index.json"]
    Failing.budget[0] = 1000
    with pytest.raises(CheckpointWriteError, match="was left as it was"):
        convert(srcs["mmapckpt"], url(dst), to="safetensors", max_shard_size=2500, overwrite=True)
    assert _files(dst) == before


def test_a_failed_conversion_to_a_new_url_leaves_nothing(failing, tmp_path) -> None:
    srcs = sources(str(tmp_path))
    for name, (to, opts) in TARGETS.items():
        dst = _dst(str(tmp_path), name, "new")
        Failing.budget[0] = 1000
        with pytest.raises(CheckpointWriteError, match="was not created"):
            convert(srcs["dcp"], url(dst), to=to, **opts)
        assert not os.path.isfile(dst) and (not os.path.isdir(dst) or os.listdir(dst) == []), name
        assert not any(n.startswith(".") for n in os.listdir(tmp_path)), name


def test_an_overwrite_at_a_url_replaces_the_checkpoint_and_keeps_other_files(medium, tmp_path) -> None:
    srcs = sources(str(tmp_path))
    d = str(tmp_path / "out")
    convert(srcs["hf"], url(d), to="safetensors", max_shard_size=2500)
    add_foreign(d)
    with pytest.raises(CheckpointExistsError):
        convert(srcs["mmapckpt"], url(d), to="mmapckpt")
    convert(srcs["mmapckpt"], url(d), to="mmapckpt", overwrite=True)  # HF -> mmapckpt: the HF files go
    assert sorted(os.listdir(d)) == sorted([".metadata", "__0_0.distcp", "__0_1.distcp", *FOREIGN])
    first = _listing(d)
    convert(srcs["dcp"], url(d), to="mmapckpt", overwrite=True)  # over itself: new names, then the old removed
    names = set(os.listdir(d))
    assert names & set(first) == {".metadata", *FOREIGN} and len(names) == 4  # the source's one file, renamed
    _assert_same(_tensors(d), state(), "mmapckpt over mmapckpt")
    convert(srcs["torch"], url(d), to="safetensors", max_shard_size=2500, overwrite=True)  # and back to HF
    convert(srcs["torch"], str(tmp_path / "local-hf"), to="safetensors", max_shard_size=2500)
    usual = sorted(os.listdir(tmp_path / "local-hf"))
    assert sorted(os.listdir(d)) == sorted([*usual, *FOREIGN])
    convert(srcs["dcp"], url(d), to="safetensors", max_shard_size=2500, overwrite=True)  # HF over HF
    shards = sorted(n for n in os.listdir(d) if n.endswith(".safetensors"))
    assert len(shards) == len(usual) - 1 and not set(shards) & set(usual)  # the usual names, with a tag
    assert all(n.startswith("model-0000") and n.count(".") == 2 for n in shards)
    assert sorted(os.listdir(d)) == sorted([*shards, "model.safetensors.index.json", *FOREIGN])
    _assert_same(_tensors(d), state(), "HF over HF")
    assert foreign_kept(d)
    _assert_same(_tensors(d), state(), "HF over mmapckpt")
    f = str(tmp_path / "weights.bin")
    convert(srcs["torch"], url(f), to="safetensors")
    with pytest.raises(CheckpointExistsError):
        convert(srcs["dcp"], url(f), to="safetensors")
    convert(srcs["dcp"], url(f), to="torch", overwrite=True)  # a file: replaced whole
    assert mmapckpt.reading.locate.detect_format(f) == "torch"
    with pytest.raises(CheckpointExistsError, match="name a file"):
        convert(srcs["dcp"], url(d), to="torch", overwrite=True)  # a directory is not replaced by a file
    with pytest.raises(CheckpointExistsError, match="is a file"):
        convert(srcs["dcp"], url(f), to="mmapckpt", overwrite=True)


def test_a_conversion_into_a_url_takes_its_lock(medium, tmp_path) -> None:
    srcs = sources(str(tmp_path))
    d = str(tmp_path / "locked")
    os.makedirs(d)
    held = Unmapped(url(d)).lock()
    try:
        with pytest.raises(CheckpointWriteError):
            convert(srcs["torch"], url(d), to="mmapckpt", overwrite=True)
    finally:
        held.release()
    assert os.listdir(d) == []


def test_a_url_destination_is_checked_like_a_path(medium, tmp_path) -> None:
    srcs = sources(str(tmp_path))
    with pytest.raises(CheckpointError, match="would replace the source"):
        convert(url(srcs["mmapckpt"]), url(srcs["mmapckpt"]), to="mmapckpt", overwrite=True)
    with pytest.raises(CheckpointError, match="would replace the source"):
        convert(url(srcs["hf"] + "/model-00001-of-00003.safetensors"), url(srcs["hf"]) + "/", to="safetensors",
                overwrite=True)
    with pytest.raises(CheckpointWriteError, match="is a URL"):
        convert(srcs["torch"], "nosuch://bucket/x", to="mmapckpt")
    with pytest.raises(mmapckpt.CheckpointNotFoundError, match="is a URL"):
        convert("nosuch://bucket/x", str(tmp_path / "y"), to="mmapckpt")
    assert not os.path.exists(tmp_path / "y") and not os.path.exists("nosuch:")
    opts = {"region": "here"}
    Unmapped.options.clear()
    convert(url(srcs["torch"]), url(tmp_path / "z"), to="dcp", storage_options=opts)
    assert Unmapped.options and all(o == opts for o in Unmapped.options)


# --------------------------------------------------------------------------- the command line
def test_the_cli_inspects_verifies_and_converts_urls(medium, tmp_path, capsys) -> None:
    srcs = sources(str(tmp_path))
    for kind, path in srcs.items():
        assert main(["inspect", path, "--json"]) == 0
        local = capsys.readouterr().out
        assert main(["inspect", url(path), "--json"]) == 0
        at_url = capsys.readouterr().out
        assert at_url.replace(url(path), path) == local, kind
    dst = str(tmp_path / "cli")
    assert main(["convert", url(srcs["dcp"]), url(dst), "--to", "mmapckpt", "-q"]) == 0
    add_foreign(dst)
    assert main(["verify", url(dst)]) == 0
    out = capsys.readouterr().out
    assert "sound" in out and url(os.path.join(dst, "config.json")) in out and "2 unreferenced files" in out
    for kind in ("safetensors", "hf", "torch"):
        assert main(["verify", url(srcs[kind]), "--json"]) == 0, kind
        assert '"ok": true' in capsys.readouterr().out
    shard = os.path.join(dst, "__0_0.distcp")
    e = next(e for e in Shard(shard).header.entries if e.fqn == "d.rows")
    raw = bytearray(open(shard, "rb").read())
    raw[e.offset + 5] ^= 0x10  # one flipped bit in d.rows
    open(shard, "wb").write(bytes(raw))
    assert main(["verify", url(dst)]) == 1
    assert "PROBLEM" in capsys.readouterr().out
    assert main(["convert", url(srcs["hf"]), url(tmp_path / "cli.pt"), "--to", "torch", "-q"]) == 0
    _assert_same(_tensors(str(tmp_path / "cli.pt")), state(), "cli")
    assert main(["inspect", url(tmp_path / "nothing")]) == 1
    assert "no such file or directory" in capsys.readouterr().err
