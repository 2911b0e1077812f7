"""Chunk layouts that do not tile their tensor, stored bytes shared other than as tied weights, and
zero-element shapes with huge dimensions, through every reader, ``verify`` and ``convert``.

Each checkpoint is written by a real writer (MmapWriter, or the stock FileSystemWriter) with the
chunks of the test's choosing (``helpers.save_chunked``, which skips DCP's own check of the plan as
a buggy or hostile writer would), or edited after a real save where no writer could produce it.
Every refusal must be a CheckpointError naming the file and the entry; nothing may be loaded or
written.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from typing import Any, Callable

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import MetadataIndex

import mmapckpt
from helpers import assert_bitwise_equal, dcp_load, save_chunked, shard_with_header
from mmapckpt import CheckpointError, EntryBoundsError, FormatError, MmapReader, MmapWriter
from mmapckpt.format.metadata import encode_metadata
from mmapckpt.dcp.metadata import read_metadata_file
from mmapckpt.tools.verify import verify_checkpoint
from strategies import layouts

SHARD = "__0_0.distcp"
WRITERS = {"mmapckpt": MmapWriter, "stock": FileSystemWriter}


def _dcp(path: str, targets: dict[str, Any], **kw: Any) -> None:
    reader = MmapReader(path, **kw)
    try:
        dcp_load(targets, reader)
    except BaseException as e:  # DCP wraps every rank's error in its CheckpointException
        raise mmapckpt.checkpoint_error(e, reader) from None


def _readers(path: str, targets: Callable[[], dict[str, Any]], out: str) -> dict[str, Callable[[], Any]]:
    """Every way to read ``path``: each must refuse it."""
    ways: dict[str, Callable[[], Any]] = {
        "dcp.load": lambda: _dcp(path, targets()),
        "dcp.load verify=True": lambda: _dcp(path, targets(), verify=True),
        "load": lambda: mmapckpt.load(path),
        "open": lambda: mmapckpt.open(path).keys(),
        "load_into": lambda: mmapckpt.load_into(targets(), path),
    }
    for to in ("safetensors", "torch", "dcp", "mmapckpt"):
        ways[f"convert --to {to}"] = (lambda to=to: mmapckpt.convert(path, os.path.join(out, to), to=to))
    return ways


def _refused_everywhere(path: str, targets: Callable[[], dict[str, Any]], entry: str, out: str,
                        cls: type[CheckpointError] = FormatError, match: str | None = None) -> None:
    os.makedirs(out, exist_ok=True)
    for what, fn in _readers(path, targets, out).items():
        with pytest.raises(cls, match=match) as e:
            fn()
        assert e.value.path and e.value.path.startswith(path), (what, e.value)
        assert e.value.entry is not None and e.value.entry.split("@")[0] == entry, (what, e.value)
    assert os.listdir(out) == []  # no conversion left anything behind
    report = verify_checkpoint(path)
    assert not report.ok and any(p.entry and p.entry.split("@")[0] == entry for p in report.problems), report.problems


def _sd() -> dict[str, torch.Tensor]:
    return {"w": torch.arange(20, dtype=torch.float32).reshape(4, 5), "b": torch.tensor([-0.0, float("nan")])}


def _targets() -> dict[str, torch.Tensor]:
    return {"w": torch.full((4, 5), 7.0), "b": torch.zeros(2)}


@pytest.mark.parametrize("writer", WRITERS)
@pytest.mark.parametrize("chunks", [
    [((0, 0), (3, 5)), ((1, 0), (1, 5))],  # the case: volumes add up to 4 rows, row 3 never stored
    [((0, 0), (3, 5))],  # one chunk smaller than its tensor
    [((0, 0), (4, 3)), ((0, 3), (4, 2)), ((2, 3), (1, 2))],  # columns, one block given twice
    [((0, 0), (2, 5)), ((2, 0), (2, 2)), ((2, 1), (2, 3))],  # an overlap of one column, a gap of the same size
])
def test_chunks_that_do_not_tile_their_tensor_are_refused_by_every_reader(tmp_path, writer, chunks):
    path = str(tmp_path / "c")
    save_chunked(_sd(), {"w": chunks}, WRITERS[writer](path))
    _refused_everywhere(path, _targets, "w", str(tmp_path / "out"))


@pytest.mark.parametrize("writer", WRITERS)
def test_chunked_tensors_that_tile_load_bitwise_everywhere(tmp_path, writer):
    sd = _sd()
    path = str(tmp_path / "c")
    grid = [((r, c), (2, w)) for r in (0, 2) for c, w in ((0, 2), (2, 3))]
    save_chunked(sd, {"w": grid[::-1]}, WRITERS[writer](path))
    into = _targets()
    mmapckpt.load_into(into, path)
    t = _targets()
    _dcp(path, t)
    for got in (mmapckpt.load(path), into, t):
        assert_bitwise_equal(got["w"], sd["w"])
        assert_bitwise_equal(got["b"], sd["b"])
    if writer == "mmapckpt":
        assert verify_checkpoint(path).ok


@given(layouts())
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_any_layout_loads_as_the_stock_reader_loads_it_or_is_refused(tmp_path, case):
    """Random layouts (tilings, and tilings damaged): a tiling loads bitwise equal to the stock
    reader's load of the stock writer's checkpoint of the same layout; anything else is refused."""
    shape, boxes = case
    if not shape or 0 in shape or not boxes or len(set(o for o, _ in boxes)) < len(boxes):
        return  # DCP keys a chunk by its offsets: two chunks at one place cannot be stored at all
    sd = {"w": torch.randn(shape).to(torch.bfloat16)}
    root = str(tmp_path / f"l{len(os.listdir(tmp_path))}")
    save_chunked(sd, {"w": boxes}, MmapWriter(root + "m"))
    counts = torch.zeros(shape, dtype=torch.int64)
    for off, sz in boxes:
        counts[tuple(slice(o, o + s) for o, s in zip(off, sz))] += 1
    target = {"w": torch.zeros(shape, dtype=torch.bfloat16)}
    if bool((counts == 1).all()):
        save_chunked(sd, {"w": boxes}, FileSystemWriter(root + "s"))
        stock = {"w": torch.zeros(shape, dtype=torch.bfloat16)}
        dcp_load(stock, FileSystemReader(root + "s"))
        _dcp(root + "m", target)
        assert_bitwise_equal(target["w"], stock["w"])
        assert_bitwise_equal(mmapckpt.load(root + "m")["w"], sd["w"])
    else:
        with pytest.raises(FormatError):
            _dcp(root + "m", target)
        with pytest.raises(FormatError):
            mmapckpt.load(root + "m")


# --------------------------------------------------------------------------- aliasing
def _alias_rows(path: str, n: int) -> None:
    """Point every row chunk of ``w`` at the first row's bytes, in the shard header and the metadata
    alike (rows of zeros: equal CRCs), and cut the file after that row: a small file claiming ``n``
    rows of data."""
    sh = os.path.join(path, SHARD)
    raw = open(sh, "rb").read()
    (hlen,) = struct.unpack_from("<Q", raw, 16)
    doc = json.loads(raw[32:32 + hlen])
    rows = [e for e in doc["entries"] if e["fqn"] == "w"]
    first = min(e["offset"] for e in rows)
    for e in rows:
        e["offset"] = first
    end = first + rows[0]["length"]
    with open(sh, "wb") as f:
        f.write(shard_with_header(raw[:end], doc, compact=True))
    meta = os.path.join(path, ".metadata")
    _, md = read_metadata_file(meta)
    for idx, info in md.storage_data.items():
        if idx.fqn == "w":
            info.offset = first
    with open(meta, "wb") as f:
        f.write(encode_metadata(md))


def test_one_chunk_listed_for_every_row_is_refused_before_anything_is_allocated(tmp_path):
    n, width = 64, 4096  # 64 rows of 16 KiB: 1 MiB claimed, 16 KiB stored
    path = str(tmp_path / "c")
    save_chunked({"w": torch.zeros(n, width)}, {"w": [((i, 0), (1, width)) for i in range(n)]}, MmapWriter(path))
    _alias_rows(path, n)
    assert os.path.getsize(os.path.join(path, SHARD)) < n * width * 4 // 32
    _refused_everywhere(path, lambda: {"w": torch.zeros(n, width)}, "w", str(tmp_path / "out"),
                        cls=EntryBoundsError, match="two of its chunks")


def test_a_shard_header_listing_one_tensor_s_chunks_at_the_same_bytes_is_refused(tmp_path):
    """The header's own rule (docs/format.md 2.2 rule 6): exact aliases are tied weights, of two names."""
    from mmapckpt.reading.shard import Shard

    path = str(tmp_path / "c")
    save_chunked({"w": torch.zeros(8, 16)}, {"w": [((i, 0), (1, 16)) for i in range(8)]}, MmapWriter(path))
    _alias_rows(path, 8)
    with pytest.raises(EntryBoundsError, match="overlaps entry 'w@") as e:
        Shard(os.path.join(path, SHARD))
    assert e.value.entry.startswith("w@")


def test_tied_weights_still_share_their_bytes_and_load_as_one_tensor(tmp_path):
    emb = torch.randn(6, 4)
    path = str(tmp_path / "c")
    mmapckpt.save({"emb.weight": emb, "head.weight": emb}, path)
    got = mmapckpt.load(path)
    assert got["emb.weight"] is got["head.weight"]
    assert_bitwise_equal(got["head.weight"], emb)
    assert verify_checkpoint(path).ok


def test_two_names_partly_sharing_their_bytes_are_refused(tmp_path):
    path = str(tmp_path / "c")
    mmapckpt.save({"a": torch.zeros(64), "b": torch.ones(64)}, path)
    meta = os.path.join(path, ".metadata")
    _, md = read_metadata_file(meta)
    a, b = (md.storage_data[MetadataIndex(n, torch.Size([0]))] for n in "ab")
    b.offset = a.offset + 128  # b's record now starts inside a's bytes (the header is left as it was)
    with open(meta, "wb") as f:
        f.write(encode_metadata(md))
    _refused_everywhere(path, lambda: {"a": torch.zeros(64), "b": torch.zeros(64)}, "b", str(tmp_path / "out"),
                        cls=EntryBoundsError, match="overlaps that of 'a'")


# --------------------------------------------------------------------------- zero-element shapes
HUGE = [[0, 2**63 - 1, 2], [0, 2**62, 4], [2**62, 0, 4]]


def _safetensors(path: str, shape: list[int]) -> None:
    head = json.dumps({"e": {"dtype": "F32", "shape": shape, "data_offsets": [0, 0]}}).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head)


@pytest.mark.parametrize("shape", HUGE + [[0, 2**63]])
def test_a_safetensors_file_with_a_zero_element_huge_shape_is_refused(tmp_path, shape):
    path = str(tmp_path / "z.safetensors")
    _safetensors(path, shape)
    os.makedirs(tmp_path / "out")
    for fn in (lambda: mmapckpt.load(path), lambda: mmapckpt.open(path).get_tensor("e"),
               lambda: mmapckpt.load_into({"e": torch.zeros(0)}, path),
               lambda: mmapckpt.convert(path, str(tmp_path / "out" / "m"), to="mmapckpt")):
        with pytest.raises(FormatError) as e:
            fn()
        assert e.value.entry == "e" and e.value.path == path
    assert os.listdir(tmp_path / "out") == []
    assert not verify_checkpoint(path).ok


@pytest.mark.parametrize("shape", HUGE)
def test_an_mmapckpt_checkpoint_with_a_zero_element_huge_shape_is_refused(tmp_path, shape):
    path = str(tmp_path / "c")
    mmapckpt.save({"e": torch.zeros(0, 3, 4), "x": torch.ones(2)}, path)
    meta = os.path.join(path, ".metadata")
    _, md = read_metadata_file(meta)
    item = md.state_dict_metadata["e"]
    item.size = torch.Size(shape)
    item.chunks[0].sizes = torch.Size(shape)
    with open(meta, "wb") as f:
        f.write(encode_metadata(md))
    sh = os.path.join(path, SHARD)
    raw = open(sh, "rb").read()
    doc = json.loads(raw[32:32 + struct.unpack_from("<Q", raw, 16)[0]])
    next(e for e in doc["entries"] if e["fqn"] == "e")["shape"] = shape
    with open(sh, "wb") as f:
        f.write(shard_with_header(raw, doc))
    _refused_everywhere(path, lambda: {"e": torch.zeros(0, 3, 4), "x": torch.zeros(2)}, "e", str(tmp_path / "out"),
                        match="no valid strides")


def test_a_shard_header_with_a_zero_element_huge_shape_is_refused(tmp_path):
    from mmapckpt.reading.shard import Shard

    path = str(tmp_path / "c")
    mmapckpt.save({"e": torch.zeros(0, 3, 4)}, path)
    sh = os.path.join(path, SHARD)
    raw = open(sh, "rb").read()
    doc = json.loads(raw[32:32 + struct.unpack_from("<Q", raw, 16)[0]])
    doc["entries"][0]["shape"] = [0, 2**62, 4]
    with open(sh, "wb") as f:
        f.write(shard_with_header(raw, doc))
    with pytest.raises(FormatError, match="no valid strides"):
        Shard(sh)


def test_verify_checks_user_metadata_as_convert_does(tmp_path):
    path = str(tmp_path / "c")
    mmapckpt.save({"x": torch.ones(2)}, path, metadata={"k": "v"})
    meta = os.path.join(path, ".metadata")
    raw = open(meta, "rb").read()
    doc = json.loads(raw[24:])
    doc["user_metadata"] = {"k": 1}
    from helpers import metadata_with_doc

    with open(meta, "wb") as f:
        f.write(metadata_with_doc(raw, doc))
    with pytest.raises(FormatError, match="object of strings"):
        mmapckpt.convert(path, str(tmp_path / "o.safetensors"), to="safetensors")
    report = verify_checkpoint(path)
    assert not report.ok and any("object of strings" in p.message for p in report.problems)
    shutil.rmtree(path)
