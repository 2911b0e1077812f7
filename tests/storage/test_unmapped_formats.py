"""Every format read at a URL: safetensors objects and Hugging Face prefixes, torch.save objects, DCP prefixes.

The medium is ``unmapped://DIR`` (tests/unmapped.py): a directory served without mappings, every
byte read through ``StoredFile.read_into`` and counted. A URL names a directory where files exist
under it and a file where it is one (reading/located.py), as object stores name them. What
``open``/``load``/``load_into`` and ``detect_format`` give at the URL is bitwise what they give for
the local path; a slice of a safetensors object reads only its byte ranges; a torch.save object is
read whole, once, and loaded with ``weights_only=True``.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from helpers import tensor_bytes
from safetensors.torch import save_file
from unmapped import Unmapped, url

import mmapckpt
from mmapckpt.reading import regions
from mmapckpt.reading.locate import detect_format, open_backend


def state() -> dict[str, torch.Tensor]:
    """bf16, NaN payloads, -0.0, empty tensors and a scalar: what a bitwise comparison must keep."""
    g = torch.Generator().manual_seed(5)
    nan32 = torch.tensor([0x7FC00001, 0x7F800123, -0x3FFFFF, 0], dtype=torch.int32).view(torch.float32)
    nan16 = torch.tensor([0x7FC1, -0x3F, 0x7F81, -0x8000], dtype=torch.int16).view(torch.bfloat16)
    return {"a.weight": torch.randn(48, 40, generator=g).to(torch.bfloat16),
            "b.nan": nan32, "b.bfnan": nan16,
            "c.zero": torch.tensor([-0.0, 0.0, -0.0], dtype=torch.float64),
            "d.int": torch.arange(1200, dtype=torch.int64).reshape(12, 100),
            "e.empty": torch.empty(0, 7), "f.scalar": torch.tensor(3.5, dtype=torch.float16),
            "g.bool": torch.tensor([True, False, True])}


def _same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(sorted(got)) == list(sorted(want))
    for k, v in want.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
        assert tensor_bytes(got[k]) == tensor_bytes(v), k


def layouts(tmp_path) -> dict[str, str]:
    """Each readable layout, local; the URL is ``url(path)``."""
    sd = state()
    out = {}
    out["safetensors file"] = str(tmp_path / "one.safetensors")
    save_file(sd, out["safetensors file"], metadata={"k": "v"})
    out["safetensors file without its suffix"] = str(tmp_path / "weights.bin")
    save_file(sd, out["safetensors file without its suffix"])
    single = tmp_path / "hf1"
    single.mkdir()
    save_file(sd, str(single / "model.safetensors"))
    (single / "config.json").write_text("{}")
    out["hf single"] = str(single)
    sharded = tmp_path / "hf"
    mmapckpt.convert(out["safetensors file"], str(sharded), to="safetensors", max_shard_size=3000)
    out["hf sharded"] = str(sharded)
    out["torch zip"] = str(tmp_path / "m.pt")
    torch.save({"model": dict(sd), "step": 7}, out["torch zip"])
    out["torch legacy"] = str(tmp_path / "legacy.pt")
    torch.save(sd, out["torch legacy"], _use_new_zipfile_serialization=False)
    out["mmapckpt"] = str(tmp_path / "ck")
    mmapckpt.save(sd, out["mmapckpt"], metadata={"k": "v"})
    out["mmapckpt commit file"] = os.path.join(out["mmapckpt"], ".metadata")
    return out


@pytest.fixture
def places(tmp_path):
    return layouts(tmp_path)


@pytest.mark.filterwarnings("ignore:.*legacy torch.save format cannot be memory-mapped")
def test_every_layout_reads_the_same_at_a_url(medium, places) -> None:
    for what, path in places.items():
        u = url(path)
        if not path.endswith(".metadata"):  # open takes a commit file as its directory; detect_format does not
            assert detect_format(u) == detect_format(path), what
        with mmapckpt.open(path) as lf, mmapckpt.open(u) as uf:
            assert uf.keys() == lf.keys() and uf.kind == lf.kind, what
            assert uf.metadata() == lf.metadata(), what
            for k in lf.keys():
                if lf.info(k).kind == "tensor":
                    assert tensor_bytes(uf.get_tensor(k)) == tensor_bytes(lf.get_tensor(k)), (what, k)
                    assert uf.info(k).dtype == lf.info(k).dtype and uf.info(k).shape == lf.info(k).shape
        local = mmapckpt.load(path)
        _same(mmapckpt.load(u), local)
        targets = {k: torch.full_like(v, 9) for k, v in local.items()}
        assert mmapckpt.load_into(targets, u) == []
        _same(targets, local)
    assert medium[0] > 0


def test_a_slice_of_a_safetensors_object_reads_only_its_ranges(medium, tmp_path, monkeypatch) -> None:
    """open reads the 8-byte length and the header; a slice of rows reads those rows; a strided selection
    reads exactly its elements, as its contiguous runs (one read per run through this medium; an object
    store joins runs close together into one request: storage/s3/reads.py)."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(300, 1000, generator=g)  # rows of 4000 bytes
    big = torch.randn(64, 8192, generator=g)  # rows of 32 KiB
    path = str(tmp_path / "w.safetensors")
    save_file({"w": w, "big": big}, path)
    with open(path, "rb") as f:
        header = int.from_bytes(f.read(8), "little")
    with mmapckpt.open(url(path)) as f:
        assert medium[0] == 8 + header  # the header only: no tensor byte
        before = medium[0]
        assert torch.equal(f.get_slice("w")[100:110], w[100:110])
        assert medium[0] - before == 10 * 4000  # exactly the rows
        before = medium[0]
        assert torch.equal(f.get_slice("w")[7], w[7])
        assert medium[0] - before == 4000
        before = medium[0]
        got = f.get_slice("w")[10:20, 3:5]  # a run of 2 elements per row
        assert torch.equal(got, w[10:20, 3:5]) and medium[0] - before == 10 * 2 * 4
        before, reads = medium[0], len(Unmapped.reads)
        got = f.get_slice("big")[::4, 100:102]  # rows 128 KiB apart: a range per selected row
        assert torch.equal(got, big[::4, 100:102])
        assert medium[0] - before == 16 * 2 * 4 and len(Unmapped.reads) - reads == 16
        before = medium[0]
        got = f.get_slice("w")[2:5, ::7]  # every element apart
        assert torch.equal(got, w[2:5, ::7]) and medium[0] - before == got.numel() * 4
        before = medium[0]
        assert f.get_slice("w")[5:5].numel() == 0 and medium[0] == before  # nothing selected, nothing read
    with mmapckpt.open(path) as f:  # locally: the same values, from the mapping
        assert torch.equal(f.get_slice("w")[2:5, ::7], w[2:5, ::7])


def test_a_slice_of_an_mmapckpt_chunk_reads_only_its_ranges(medium, tmp_path) -> None:
    w = torch.arange(300 * 1000, dtype=torch.float32).reshape(300, 1000)
    path = str(tmp_path / "c")
    mmapckpt.save({"w": w}, path)
    with mmapckpt.open(url(path)) as f:
        before = medium[0]
        assert torch.equal(f.get_slice("w")[40:45, 1:], w[40:45, 1:])
        assert medium[0] - before == 5 * 999 * 4  # exactly the elements: a run per row
    with mmapckpt.open(url(path), verify=True) as f:  # the checksum needs the whole chunk
        before = medium[0]
        assert torch.equal(f.get_slice("w")[40:45], w[40:45])
        assert medium[0] - before >= w.numel() * 4


def test_slices_at_a_url_equal_the_local_ones(medium, tmp_path) -> None:
    """Every kind of index on every dtype, through the ranged reads and through the mapping."""
    sd = state()
    path = str(tmp_path / "s.safetensors")
    save_file(sd, path)
    cube = torch.arange(5 * 6 * 7, dtype=torch.int16).reshape(5, 6, 7)
    save_file({"cube": cube}, str(tmp_path / "cube.safetensors"))
    indices = [(slice(None),), (slice(1, None, 2),), (Ellipsis, 0), (slice(2, 3), slice(None, None, 3)), (-1,)]
    for p, names in ((path, [k for k, v in sd.items() if v.dim() >= 1 and v.numel()]),
                     (str(tmp_path / "cube.safetensors"), ["cube"])):
        with mmapckpt.open(p) as lf, mmapckpt.open(url(p)) as uf:
            for k in names:
                for ix in indices + ([(1, slice(None, None, 2), slice(1, 6, 4))] if k == "cube" else []):
                    try:
                        want = lf.get_slice(k)[ix]
                    except IndexError:
                        continue
                    assert tensor_bytes(uf.get_slice(k)[ix]) == tensor_bytes(want), (k, ix)


def test_a_torch_object_is_read_whole_once_and_loaded_without_code(medium, tmp_path) -> None:
    path = str(tmp_path / "m.pt")
    sd = state()
    torch.save(sd, path)
    with mmapckpt.open(url(path)) as f:
        size = os.path.getsize(path)
        whole = [r for r in Unmapped.reads if r[2] == size]
        assert len(whole) == 1 and whole[0][1] == 0  # read whole, once
        assert medium[0] - size < 256  # besides: detection (2 bytes, then the zip's end records)
        _same({k: f.get_tensor(k) for k in f.keys()}, sd)

    marker = tmp_path / "code-ran"

    class Evil:
        def __reduce__(self):
            return (os.makedirs, (str(marker),))

    bad = str(tmp_path / "evil.pt")
    torch.save({"w": torch.ones(2), "x": Evil()}, bad)
    with pytest.raises(mmapckpt.FormatError, match="weights_only=True"):
        mmapckpt.open(url(bad))
    assert not marker.exists()


def test_a_url_names_a_directory_where_files_are_under_it_and_a_file_where_it_is_one(medium, tmp_path) -> None:
    sd = state()
    d = tmp_path / "hf"
    d.mkdir()
    save_file(sd, str(d / "model.safetensors"))
    assert detect_format(url(d)) == detect_format(url(d) + "/") == "safetensors"
    assert open_backend(url(d)).root == url(d)
    assert open_backend(url(d / "model.safetensors")).root == url(d)
    with pytest.raises(mmapckpt.CheckpointNotFoundError, match="no such file or directory"):
        mmapckpt.open(url(d / "missing.safetensors"))
    with pytest.raises(mmapckpt.CheckpointNotFoundError):
        mmapckpt.open(url(d / "model.safetensors") + "/")  # a directory only, and there is none
    (d / "notes.txt").write_text("hello")
    with pytest.raises(mmapckpt.CheckpointNotFoundError, match="not a recognised checkpoint"):
        mmapckpt.open(url(d / "notes.txt"))
    (d / "model.safetensors").unlink()
    with pytest.raises(mmapckpt.CheckpointNotFoundError, match="model.safetensors"):
        mmapckpt.open(url(d))


def test_an_index_at_a_url_names_files_inside_its_prefix_only(medium, tmp_path) -> None:
    d = tmp_path / "hf"
    d.mkdir()
    save_file({"w": torch.ones(3)}, str(tmp_path / "outside.safetensors"))
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "../outside.safetensors"}}))
    with pytest.raises(mmapckpt.UnsafePathError):
        mmapckpt.open(url(d))
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "gone.safetensors"}}))
    with pytest.raises(mmapckpt.CheckpointError, match="missing") as info:
        mmapckpt.open(url(d))
    assert info.value.path == url(d / "gone.safetensors") and info.value.entry == "w"


def test_storage_options_reach_the_medium(medium, tmp_path) -> None:
    path = str(tmp_path / "w.safetensors")
    save_file({"w": torch.ones(3)}, path)
    opts = {"endpoint": "here"}
    assert detect_format(url(path), storage_options=opts) == "safetensors"
    open_backend(url(path), storage_options=opts).files.close()
    assert Unmapped.options and all(o == opts for o in Unmapped.options)
    assert detect_format(path, storage_options=opts) == "safetensors"  # a local path takes none and ignores them


@pytest.mark.filterwarnings("ignore:.*legacy torch.save format cannot be memory-mapped")
def test_the_staged_path_at_a_url(medium, places, monkeypatch) -> None:
    """load_into's accelerator path (pinned staging ring), on CPU targets: from memory, not from a mapping."""
    from mmapckpt.io import staging

    monkeypatch.setattr(staging, "STAGE_CPU_TARGETS", True)
    for what, path in places.items():
        local = mmapckpt.load(path)
        targets = {k: torch.full_like(v, 5) for k, v in local.items()}
        assert mmapckpt.load_into(targets, url(path), staging_bytes=64, staging_buffers=2) == [], what
        _same(targets, local)
