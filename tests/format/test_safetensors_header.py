"""format/safetensors.py: the safetensors header parser, against real files and hostile ones."""

from __future__ import annotations

import json
import struct

import helpers
import pytest
import safetensors
import safetensors.torch
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mmapckpt import CheckpointError, FormatError, TruncatedFileError, UnknownDtypeError
from mmapckpt.format.safetensors import MAX_HEADER_SIZE, SAFETENSORS_DTYPES, parse_header
from mmapckpt.reading.safetensors_files import SafetensorsFile, read_header

CODES = {dt: code for code, dt in SAFETENSORS_DTYPES.items()}


def _file(path, header: object, data: bytes = b"", *, raw: bytes | None = None) -> str:
    body = raw if raw is not None else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(body)) + body + data)
    return str(path)


def _entry(dtype: str, shape: list, begin: int, end: int) -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


def test_exact_bytes_of_a_small_file(tmp_path) -> None:
    body = b'{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},"__metadata__":{"k":"v"}}'
    path = tmp_path / "x.safetensors"
    path.write_bytes(struct.pack("<Q", len(body)) + body + b"\x07\x09")
    h = read_header(str(path))
    assert h.data_start == 8 + len(body) and h.file_size == 8 + len(body) + 2
    assert h.metadata == {"k": "v"}
    assert list(h.entries) == ["a"]
    e = h.entries["a"]
    assert (e.dtype, e.shape, e.begin, e.end) == (torch.uint8, (2,), 0, 2)
    t = SafetensorsFile(str(path)).view(h.data_start + e.begin, 2, e.dtype, e.shape)
    assert t.tolist() == [7, 9]


def test_files_written_by_safetensors(tmp_path) -> None:
    """Every dtype of the table, as save_file writes it: dtypes, shapes and offsets as safe_open reports them."""
    g = torch.Generator().manual_seed(0)
    sd = {}
    for i, dt in enumerate(SAFETENSORS_DTYPES.values()):
        raw = torch.randint(0, 256, (3 * (i + 1) * dt.itemsize,), dtype=torch.uint8, generator=g)
        sd[f"t{i}"] = (raw & 1 if dt == torch.bool else raw).view(dt).reshape(3, -1) if dt != torch.bool \
            else (raw & 1).bool().reshape(3, -1)
    sd["empty"] = torch.zeros(0, 4)
    sd["scalar"] = torch.tensor(2.5)
    path = str(tmp_path / "m.safetensors")
    safetensors.torch.save_file(sd, path, metadata={"format": "pt", "step": "12"})
    h = read_header(path)
    assert h.metadata == {"format": "pt", "step": "12"}
    with safetensors.safe_open(path, "pt") as f:
        assert sorted(h.entries) == f.keys()
        assert h.metadata == f.metadata()
        for name, e in h.entries.items():
            sl = f.get_slice(name)
            assert CODES[e.dtype] == sl.get_dtype() and list(e.shape) == sl.get_shape()
            stored = SafetensorsFile(path).view(h.data_start + e.begin, e.end - e.begin, e.dtype, e.shape)
            helpers.assert_bitwise_equal(stored, f.get_tensor(name), name)


def test_no_metadata_is_none_and_empty_metadata_is_empty(tmp_path) -> None:
    for meta, want in ((None, None), ({}, {})):
        hdr: dict = {"a": _entry("U8", [1], 0, 1)}
        if meta is not None:
            hdr["__metadata__"] = meta
        path = _file(tmp_path / "m.safetensors", hdr, b"\x01")
        assert read_header(path).metadata == want
        with safetensors.safe_open(path, "pt") as f:
            assert f.metadata() == want  # the behaviour mmapckpt.open(...).metadata() copies


HOSTILE = {
    "not JSON": (None, b"\x00", b"{not json}"),
    "not UTF-8": (None, b"", b'{"\xff": 1}'),
    "an array": ([], b"", None),
    "a number": (3, b"", None),
    "entry not an object": ({"a": [1, 2]}, b"", None),
    "no dtype": ({"a": {"shape": [1], "data_offsets": [0, 1]}}, b"\x00", None),
    "dtype not a string": ({"a": _entry(5, [1], 0, 1)}, b"\x00", None),  # type: ignore[arg-type]
    "shape not a list": ({"a": _entry("U8", 1, 0, 1)}, b"\x00", None),  # type: ignore[arg-type]
    "negative dim": ({"a": _entry("U8", [-1], 0, 1)}, b"\x00", None),
    "bool dim": ({"a": _entry("U8", [True], 0, 1)}, b"\x00", None),
    "float dim": ({"a": _entry("U8", [1.0], 0, 1)}, b"\x00", None),
    "offsets of three": ({"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1, 2]}}, b"\x00", None),
    "negative offset": ({"a": _entry("U8", [1], -1, 0)}, b"\x00", None),
    "end before begin": ({"a": _entry("U8", [0], 1, 0)}, b"\x00", None),
    "length not numel * itemsize": ({"a": _entry("F32", [2], 0, 4)}, b"\x00" * 4, None),
    "huge shape": ({"a": _entry("F32", [2 ** 40, 2 ** 40], 0, 4)}, b"\x00" * 4, None),
    "overlap": ({"a": _entry("U8", [2], 0, 2), "b": _entry("U8", [2], 1, 3)}, b"\x00" * 3, None),
    "same bytes twice": ({"a": _entry("U8", [2], 0, 2), "b": _entry("U8", [2], 0, 2)}, b"\x00" * 2, None),
    "gap": ({"a": _entry("U8", [1], 0, 1), "b": _entry("U8", [1], 2, 3)}, b"\x00" * 3, None),
    "trailing bytes": ({"a": _entry("U8", [1], 0, 1)}, b"\x00" * 5, None),
    "metadata values not strings": ({"__metadata__": {"k": 1}}, b"", None),
    "metadata a list": ({"__metadata__": ["k"]}, b"", None),
    "duplicate name": (None, b"\x00\x00", (b'{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},'
                                            b'"a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}')),
    "deep nesting": (None, b"", b"{\"a\":" + b"[" * 100_000 + b"]" * 100_000 + b"}"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_headers_are_refused_naming_the_file(tmp_path, case) -> None:
    header, data, raw = HOSTILE[case]
    path = _file(tmp_path / "bad.safetensors", header, data, raw=raw)
    with pytest.raises(FormatError) as ei:
        read_header(path)
    assert ei.value.path == path
    # safetensors refuses each of them too (with its own error type)
    with pytest.raises(Exception), safetensors.safe_open(path, "pt") as f:  # noqa: B017
        for k in f.keys():  # noqa: SIM118 - a safe_open handle, not a dict
            f.get_tensor(k)


def test_errors_name_the_entry(tmp_path) -> None:
    path = _file(tmp_path / "e.safetensors", {"good": _entry("U8", [1], 0, 1), "bad.w": _entry("F32", [3], 1, 5)},
                 b"\x00" * 5)
    with pytest.raises(FormatError) as ei:
        read_header(path)
    assert ei.value.entry == "bad.w" and "12 bytes" in str(ei.value)


def test_duplicate_name_is_named(tmp_path) -> None:
    _, data, raw = HOSTILE["duplicate name"]
    with pytest.raises(FormatError, match="twice") as ei:
        read_header(_file(tmp_path / "d.safetensors", None, data, raw=raw))
    assert ei.value.entry == "a"


def test_unknown_dtype(tmp_path) -> None:
    path = _file(tmp_path / "u.safetensors", {"a": _entry("F8_E8M0", [2], 0, 2)}, b"\x00\x00")
    with pytest.raises(UnknownDtypeError, match="F8_E8M0") as ei:
        read_header(path)
    assert ei.value.entry == "a"


def test_length_prefix_is_bounded(tmp_path) -> None:
    p = tmp_path / "big.safetensors"
    p.write_bytes(struct.pack("<Q", MAX_HEADER_SIZE + 1) + b"{}")
    with pytest.raises(FormatError, match="exceeds the limit"):
        read_header(str(p))
    p.write_bytes(struct.pack("<Q", 2 ** 63) + b"{}")
    with pytest.raises(FormatError):
        read_header(str(p))
    p.write_bytes(struct.pack("<Q", 100) + b"{}")
    with pytest.raises(TruncatedFileError, match="past the end"):
        read_header(str(p))
    p.write_bytes(b"\x02\x00\x00")
    with pytest.raises(TruncatedFileError):
        read_header(str(p))


def test_data_past_the_end_is_truncation(tmp_path) -> None:
    path = _file(tmp_path / "t.safetensors", {"a": _entry("U8", [4], 0, 4)}, b"\x00\x00")
    with pytest.raises(TruncatedFileError) as ei:
        read_header(path)
    assert ei.value.entry == "a"


def test_not_a_regular_file(tmp_path) -> None:
    with pytest.raises(CheckpointError):
        read_header(str(tmp_path))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=st.one_of(st.binary(max_size=200),
                      st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
                                   lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=5), c,
                                                                                       max_size=3),
                                   max_leaves=12).map(lambda d: json.dumps({"a": d}).encode())),
       data=st.binary(max_size=16))
def test_random_headers_raise_only_checkpoint_errors(tmp_path, body, data) -> None:
    try:
        h = parse_header(body, 8 + len(body) + len(data), "f")
    except CheckpointError as e:
        assert e.path == "f"
        return
    covered = sum(e.end - e.begin for e in h.entries.values())
    assert covered == len(data)  # whatever is accepted tiles the data exactly
