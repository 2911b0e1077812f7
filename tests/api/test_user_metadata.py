"""User metadata: ``mmapckpt.save(sd, path, metadata={...})`` and ``MmapWriter(path, metadata=...)``.

Stored as the optional ``user_metadata`` key of the ``.metadata`` body (minor version 1),
read with ``mmapckpt.format.metadata.read_user_metadata``; str -> str only, as safetensors.
"""

from __future__ import annotations

import json
import os
import pickle
import struct
import warnings
import zlib

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import assert_bitwise_equal
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint import FileSystemWriter

import mmapckpt
from mmapckpt import FormatError, MmapReader, MmapWriter
from mmapckpt.format import metadata as mf
from mmapckpt.storage.commits import read_user_metadata_file


def _meta(path: str) -> str:
    return os.path.join(path, ".metadata")


def _preamble(path: str) -> tuple[bytes, int, int]:
    with open(_meta(path), "rb") as f:
        magic, major, minor, _crc, _n = struct.unpack("<8sHHIQ", f.read(24))
    return magic, major, minor


def _body(path: str) -> dict:
    with open(_meta(path), "rb") as f:
        return json.loads(f.read()[24:])


def _rewrite_body(path: str, doc: dict, minor: int = 0) -> None:
    """A well-formed metadata file (right magic, length and CRC) around ``doc``: hostile content only."""
    body = json.dumps(doc).encode()
    with open(_meta(path), "wb") as f:
        f.write(struct.pack("<8sHHIQ", mf.META_MAGIC, mf.META_MAJOR, minor, zlib.crc32(body), len(body)) + body)


def test_save_stores_the_metadata_and_load_is_unchanged(tmp_path) -> None:
    sd = {"w": torch.randn(4, 3), "b": torch.arange(5, dtype=torch.bfloat16)}
    user = {"step": "100", "author": "me", "config": json.dumps({"lr": 1e-3}), "empty": ""}
    mmapckpt.save(sd, tmp_path / "c", metadata=user)
    assert read_user_metadata_file(_meta(str(tmp_path / "c"))) == user
    assert _body(str(tmp_path / "c"))["user_metadata"] == user
    out = mmapckpt.load(tmp_path / "c")
    for k, v in sd.items():
        assert_bitwise_equal(out[k], v, k)
    targets = {k: torch.zeros_like(v) for k, v in sd.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # DCP's "assuming the intent is to load in a single process"
        dcp.load(targets, storage_reader=MmapReader(tmp_path / "c"), no_dist=True)
    for k, v in sd.items():
        assert_bitwise_equal(targets[k], v, k)


def test_without_metadata_there_is_no_key(tmp_path) -> None:
    mmapckpt.save({"w": torch.ones(2)}, tmp_path / "c")
    assert read_user_metadata_file(_meta(str(tmp_path / "c"))) is None
    assert _preamble(str(tmp_path / "c"))[1:] == (mf.META_MAJOR, mf.META_MINOR)
    assert "user_metadata" not in _body(str(tmp_path / "c"))


def test_a_version_1_file_with_user_metadata_is_1_1_and_1_0_readers_ignore_the_key(tmp_path) -> None:
    """Version 1 bodies: the key makes the file 1.1 (an optional key); without it the file is 1.0, byte for byte."""
    mmapckpt.save({"w": torch.ones(2)}, tmp_path / "c")
    md = MmapReader(tmp_path / "c").read_metadata()
    plain = mf.encode_metadata(md, major=1)
    tagged = mf.encode_metadata(md, {"a": "b"}, major=1)
    assert struct.unpack_from("<8sHH", plain)[1:] == (1, 0)
    assert struct.unpack_from("<8sHH", tagged)[1:] == (1, 1)
    assert "user_metadata" not in json.loads(plain[24:])
    for data in (plain, tagged):  # the index of entries is the same: the key is ignored
        assert list(mf.decode_index(data, "x").entries) == ["w"]
    with open(_meta(str(tmp_path / "c")), "wb") as f:
        f.write(tagged)
    assert read_user_metadata_file(_meta(str(tmp_path / "c"))) == {"a": "b"}
    assert_bitwise_equal(mmapckpt.load(tmp_path / "c")["w"], torch.ones(2))


def test_mmapwriter_takes_metadata_for_dcp_save(tmp_path) -> None:
    sd = {"w": torch.randn(3)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(sd, storage_writer=MmapWriter(tmp_path / "c", metadata={"run": "r1"}), no_dist=True)
    assert read_user_metadata_file(_meta(str(tmp_path / "c"))) == {"run": "r1"}


@pytest.mark.parametrize("bad", [{"step": 100}, {1: "a"}, {"a": None}, {"a": b"x"}, [("a", "b")], "a=b"])
def test_non_string_metadata_is_a_type_error_before_anything_is_written(tmp_path, bad) -> None:
    with pytest.raises(TypeError, match="str to str"):
        mmapckpt.save({"w": torch.ones(2)}, tmp_path / "c", metadata=bad)
    assert not os.path.exists(tmp_path / "c")
    with pytest.raises(TypeError, match="str to str"):
        MmapWriter(tmp_path / "d", metadata=bad)


def test_stock_checkpoints_have_none(tmp_path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"w": torch.ones(2)}, storage_writer=FileSystemWriter(tmp_path / "s"), no_dist=True)
    assert read_user_metadata_file(_meta(str(tmp_path / "s"))) is None


@pytest.mark.parametrize("value", [["a"], "a", 5, {"a": 1}, {"a": None}, {"a": ["b"]}, {"a": {"b": "c"}}])
def test_hostile_user_metadata_is_a_format_error_naming_the_file(tmp_path, value) -> None:
    mmapckpt.save({"w": torch.ones(2)}, tmp_path / "c", metadata={"a": "b"})
    doc = _body(str(tmp_path / "c"))
    doc["user_metadata"] = value
    _rewrite_body(str(tmp_path / "c"), doc)
    with pytest.raises(FormatError, match="user_metadata") as ei:
        read_user_metadata_file(_meta(str(tmp_path / "c")))
    assert ei.value.path == _meta(str(tmp_path / "c"))


@pytest.mark.parametrize("damage", ["crc", "truncated", "not-json", "not-object", "magic"])
def test_damaged_metadata_files_are_format_errors(tmp_path, damage) -> None:
    mmapckpt.save({"w": torch.ones(2)}, tmp_path / "c", metadata={"a": "b"})
    meta = _meta(str(tmp_path / "c"))
    with open(meta, "rb") as f:
        data = bytearray(f.read())
    if damage == "crc":
        data[-2] ^= 1
    elif damage == "truncated":
        data = data[:-3]
    elif damage == "magic":
        data[1:3] = b"XX"
    if damage in ("not-json", "not-object"):
        body = b"{not json" if damage == "not-json" else b"[1, 2]"
        data = bytearray(struct.pack("<8sHHIQ", mf.META_MAGIC, 1, 1, zlib.crc32(body), len(body)) + body)
    with open(meta, "wb") as f:
        f.write(data)
    with pytest.raises(FormatError) as ei:
        read_user_metadata_file(meta)
    assert ei.value.path == meta


def test_a_pickle_in_place_of_the_metadata_is_never_run(tmp_path) -> None:
    class Boom:
        def __reduce__(self):  # would run on unpickling
            return (os.system, ("touch " + str(tmp_path / "ran"),))

    os.makedirs(tmp_path / "c")
    with open(_meta(str(tmp_path / "c")), "wb") as f:
        pickle.dump(Boom(), f)
    # a stock (pickled) metadata file has no user metadata: it is not even unpickled for it
    assert read_user_metadata_file(_meta(str(tmp_path / "c"))) is None
    assert not os.path.exists(tmp_path / "ran")
    with open(_meta(str(tmp_path / "c")), "wb") as f:
        f.write(b"PK\x03\x04 neither kind")
    with pytest.raises(FormatError):
        read_user_metadata_file(_meta(str(tmp_path / "c")))


_TEXT = st.text(max_size=40)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(user=st.dictionaries(_TEXT, _TEXT, max_size=8))
def test_any_str_to_str_dict_round_trips(tmp_path_factory, user) -> None:
    path = tmp_path_factory.mktemp("u") / "c"
    mmapckpt.save({"w": torch.ones(1)}, path, metadata=user)
    got = read_user_metadata_file(_meta(str(path)))
    assert got == user and type(got) is dict
