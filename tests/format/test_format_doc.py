"""docs/format.md stays true: its stand-alone reader reads real checkpoints, its tables match the code."""

from __future__ import annotations

import ast
import io
import os
import re
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import mmapckpt
from mmapckpt.format import layout as fmt
from mmapckpt.format import metadata as mf
from mmapckpt.format.metadata.framing import META_PREAMBLE
from helpers import assert_bitwise_equal, dcp_save, tensor_bytes
from strategies import ALL_DTYPES, flatten, tensor_from_bytes

DOC = Path(__file__).resolve().parents[2] / "docs" / "format.md"


def doc_text() -> str:
    return DOC.read_text(encoding="utf-8")


def example_code() -> str:
    blocks = re.findall(r"```python\n(.*?)```", doc_text(), flags=re.S)
    [code] = [b for b in blocks if "def read_shard" in b]
    return code


@pytest.fixture(scope="module")
def reader() -> dict[str, Any]:
    """The doc's example, run in a namespace of its own."""
    ns: dict[str, Any] = {"__name__": "format_doc_example"}
    exec(compile(example_code(), str(DOC), "exec"), ns)
    return ns


def test_example_imports_only_the_standard_library_and_numpy() -> None:
    imported = set()
    for node in ast.walk(ast.parse(example_code())):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add((node.module or "").split(".")[0])
    assert imported <= {"struct", "json", "zlib", "numpy"}, imported
    names = {n.id for n in ast.walk(ast.parse(example_code())) if isinstance(n, ast.Name)}
    assert not names & {"mmapckpt", "torch"}


def _state_dict() -> dict[str, Any]:
    g = torch.Generator().manual_seed(2024)
    sd: dict[str, Any] = {}
    for i, dt in enumerate(ALL_DTYPES):
        n = 3 * 5 * dt.itemsize
        raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).numpy().tobytes()
        sd[f"t{i}_{str(dt).split('.')[1]}"] = tensor_from_bytes(raw, dt, (3, 5))
    base = torch.randn(8, 9, generator=g)
    sd["view"] = {"strided": base[1::2, ::3], "transposed": base.t()}
    sd["scalar"] = torch.tensor(-0.0)
    sd["empty"] = torch.empty(4, 0, 2, dtype=torch.int16)
    sd["page"] = torch.randn(3000, generator=g)  # 12000 bytes: page-aligned
    sd["step"] = 17
    return sd


@pytest.mark.parametrize("threads, major", [(1, 2), (3, 2), (3, 1)])
def test_stand_alone_reader_reads_a_real_checkpoint(tmp_path, reader, threads: int, major: int) -> None:
    sd = _state_dict()
    dcp_save(sd, mmapckpt.MmapWriter(tmp_path, thread_count=threads))
    if major == 1:  # the same checkpoint with its metadata in the version-1 form
        from helpers import as_metadata_v1
        as_metadata_v1(tmp_path)
    records = reader["storage_records"](str(tmp_path / ".metadata"))
    flat = flatten(sd)
    shards: dict[str, dict] = {}
    seen = set()
    for rec in records:
        shard = shards.setdefault(rec["relative_path"], reader["read_shard"](str(tmp_path / rec["relative_path"])))
        value = flat[rec["fqn"]]
        seen.add(rec["fqn"])
        if rec["offset"] is None:
            got = shard[(rec["fqn"], None)]
            assert len(got) == rec["length"]
            assert torch.load(io.BytesIO(got), weights_only=True) == value
            continue
        arr = shard[(rec["fqn"], tuple(rec["offset"]))]
        assert isinstance(arr, np.ndarray)
        assert arr.shape == tuple(value.shape) and arr.dtype.itemsize == value.element_size()
        assert arr.tobytes() == tensor_bytes(value), rec["fqn"]
        with open(tmp_path / rec["relative_path"], "rb") as f:  # the view is of the bytes at file_offset
            f.seek(rec["file_offset"])
            assert f.read(rec["length"]) == arr.tobytes()
        back = torch.from_numpy(np.array(arr))  # the doc's recipe: numpy type, or bits viewed as the dtype
        assert_bitwise_equal(back if back.dtype == value.dtype else back.view(value.dtype), value, rec["fqn"])
    assert seen == set(flat)
    assert len(shards) == threads


def test_stand_alone_reader_values_match_torch(tmp_path, reader) -> None:
    sd = {"f": torch.tensor([[1.5, -2.0], [0.25, 3.0]]), "bf": torch.tensor([1.0, -0.5], dtype=torch.bfloat16),
          "i": torch.tensor([-7, 9], dtype=torch.int64), "b": torch.tensor([True, False, True])}
    dcp_save(sd, mmapckpt.MmapWriter(tmp_path))
    shard = reader["read_shard"](str(tmp_path / "__0_0.distcp"))
    assert shard[("f", (0, 0))].tolist() == [[1.5, -2.0], [0.25, 3.0]]
    assert shard[("i", (0,))].tolist() == [-7, 9]
    assert shard[("b", (0,))].tolist() == [True, False, True]
    bf = torch.from_numpy(np.array(shard[("bf", (0,))])).view(torch.bfloat16)  # the doc's recipe for bits
    assert bf.tolist() == [1.0, -0.5]


@pytest.mark.parametrize("damage", ["magic", "truncated", "header-crc", "overlap"])
def test_stand_alone_reader_refuses_bad_files(tmp_path, reader, damage: str) -> None:
    dcp_save({"w": torch.randn(2000), "b": torch.ones(10)}, mmapckpt.MmapWriter(tmp_path))
    p = tmp_path / "__0_0.distcp"
    raw = bytearray(p.read_bytes())
    if damage == "magic":
        raw[0:4] = b"XXXX"
    elif damage == "truncated":
        raw = raw[:5000]
    elif damage == "header-crc":
        raw[40] ^= 1
    else:  # a self-consistent header whose two entries share bytes
        import json
        import zlib
        hlen = struct.unpack_from("<Q", raw, 16)[0]
        doc = json.loads(raw[32:32 + hlen])
        doc["entries"][1]["offset"] = doc["entries"][0]["offset"]
        body = json.dumps(doc, separators=(",", ":")).encode()
        raw[16:28] = struct.pack("<QI", len(body), zlib.crc32(body))
        raw[32:32 + max(hlen, len(body))] = body.ljust(max(hlen, len(body)), b"\0")
    p.write_bytes(bytes(raw))
    with pytest.raises(ValueError):
        reader["read_shard"](str(p))
    with pytest.raises(mmapckpt.FormatError):  # and mmapckpt agrees the file is bad
        from mmapckpt.reading.shard import Shard
        Shard(str(p))


# --------------------------------------------------------------------------- tables and constants
def _doc_dtype_rows() -> list[tuple[str, int, str, str]]:
    rows = re.findall(r"^\| `(\w+)` \| (\d+) \| `torch\.(\w+)` \| `([<>]?[\w?]+)`", doc_text(), flags=re.M)
    return [(n, int(s), t, np_) for n, s, t, np_ in rows]


def test_dtype_table_matches_the_code(reader) -> None:
    rows = _doc_dtype_rows()
    assert [r[0] for r in rows] == [name for name, _, _ in fmt._DTYPE_TABLE]
    for name, size, attr, npdt in rows:
        assert (name, attr, size) in fmt._DTYPE_TABLE
        assert reader["NUMPY"][name] == npdt
        assert np.dtype(npdt).itemsize == size
        if name in fmt.DTYPES:
            assert fmt.DTYPES[name][1] == size == getattr(torch, attr).itemsize


def test_constants_match_the_code() -> None:
    text = doc_text()
    assert f'"{fmt._PREAMBLE.format}"' in text
    assert f'"{META_PREAMBLE.format}"' in text
    assert f"**{fmt.MAX_HEADER_SIZE}**" in text
    assert " ".join(f"{b:02x}" for b in fmt.MAGIC) in text
    assert " ".join(f"{b:02x}" for b in mf.META_MAGIC) in text
    assert fmt.PREAMBLE_SIZE == 32 and struct.calcsize("<8sHHIQ") == 24
    assert mf.MAX_METADATA_SIZE == 2**30 and "1 GiB" in text
    assert fmt.MIN_ALIGNMENT == 64 and fmt.MAX_NDIM == 64
    assert f"version {fmt.FORMAT_MAJOR}.{fmt.FORMAT_MINOR}" in text
    assert "right after the header rounded up to 64" in text
    entries, _ = fmt.layout_entries([fmt.EntrySpec("x", (0,), "tensor", "uint8", (1,), 1)])
    head = len(fmt.encode_header(entries))  # the offset reserved at 4 digits, written with 3 or fewer
    assert entries[0].offset % 64 == 0 and head <= entries[0].offset < head + 4 + 64
