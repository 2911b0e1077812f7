"""The header-agreement fast path: a shard header that is byte for byte what the writer wrote for the
metadata's records is taken without decoding its entries; any difference falls back to the per-entry checks."""
from __future__ import annotations

import json
import struct
import zlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mmapckpt
from mmapckpt.format import layout as fmt

_spec = st.one_of(
    st.builds(lambda n, fqn, c: fmt.EntrySpec(fqn, (c, 0), "tensor", "bfloat16", (1, n), 2 * n),
              st.integers(0, 300), st.text(max_size=20), st.integers(0, 10**6)),
    st.builds(lambda n, fqn: fmt.EntrySpec(fqn, None, "bytes", None, (), n), st.integers(0, 300), st.text(max_size=20)),
)


def _records(entries: list[fmt.Entry]) -> list[tuple]:
    return [(e.fqn, e.chunk_offsets, e.kind, e.dtype, e.shape, e.offset, e.length) for e in entries]


def _changed(rec: tuple, field: int) -> tuple:
    """``rec`` with one field changed to another value of the same type."""
    v = rec[field]
    new = {0: lambda: v + "x", 1: lambda: (*v, 0), 2: lambda: "bytes" if v == "tensor" else "encoded", 3: lambda: "float16" if v != "float16" else "int16", 4: lambda: (*v, 1), 5: lambda: v + 64,
           6: lambda: v + 1}[field]()
    return rec[:field] + (new,) + rec[field + 1:]


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs=st.lists(_spec, min_size=1, max_size=12, unique_by=lambda s: (s.fqn, s.chunk_offsets)),
       save_id=st.text(min_size=1, max_size=12), pick=st.data())
def test_header_agrees_with_its_own_records_and_with_no_other(specs, save_id, pick) -> None:
    plan = fmt.plan_shard(specs, 4096, save_id)
    crcs = pick.draw(st.lists(st.integers(0, 2**32 - 1), min_size=len(specs), max_size=len(specs)))
    body = plan.header(crcs)[fmt.PREAMBLE_SIZE:]
    records = _records(plan.entries)
    assert fmt.header_crcs(body, save_id, records) == crcs
    assert fmt.header_agrees(body, save_id, records)
    assert fmt.header_crcs(body, save_id + "x", records) is None
    assert fmt.header_crcs(body, None, records) is None
    assert not fmt.header_agrees(body, save_id + "x", records) and not fmt.header_agrees(body, None, records)
    i = pick.draw(st.integers(0, len(records) - 1))
    # a bytes entry's header has no chunk offsets, dtype or shape (the metadata's records have none either)
    field = pick.draw(st.sampled_from((0, 1, 2, 3, 4, 5, 6) if records[i][2] == "tensor" else (0, 5, 6)))
    other = records[:i] + [_changed(records[i], field)] + records[i + 1:]
    assert fmt.header_crcs(body, save_id, other) is None, (i, field)
    assert not fmt.header_agrees(body, save_id, other), (i, field)
    assert fmt.header_crcs(body, save_id, records[:-1]) is None
    assert not fmt.header_agrees(body, save_id, records[:-1])
    if len(records) > 1:
        assert fmt.header_crcs(body, save_id, records[::-1]) is None or records[0][:5] == records[-1][:5]


@pytest.mark.parametrize("spelled", ["ABCDEF12", "abcdefg1", "abcdef1", "abcdef12 ", "-bcdef12"])
def test_a_crc_spelled_otherwise_than_the_writer_spells_it_is_refused(spelled) -> None:
    """The writer spells each CRC-32 as 8 lower-case hex digits; a header whose CRC-32 text is anything else is not
    the header written for the records (the per-entry checks then decide), and never a number read loosely."""
    specs = [fmt.EntrySpec("a", (0, 0), "tensor", "bfloat16", (1, 4), 8),
             fmt.EntrySpec("b", None, "bytes", None, (), 3)]
    plan = fmt.plan_shard(specs, 4096, "sid")
    body = plan.header([0xABCDEF12, 7])[fmt.PREAMBLE_SIZE:]
    records = _records(plan.entries)
    assert fmt.header_crcs(body, "sid", records) == [0xABCDEF12, 7]
    assert b'"crc32":"abcdef12"}' in body
    tampered = body.replace(b'"crc32":"abcdef12"}', b'"crc32":"' + spelled.encode() + b'"}')
    assert fmt.header_crcs(tampered, "sid", records) is None
    assert not fmt.header_agrees(tampered, "sid", records)


def _rewrite_compact(path, edit) -> None:
    """Replace the shard's header by ``edit(doc)`` in the writer's own compact spelling, checksum fixed."""
    data = bytearray(path.read_bytes())
    hlen = struct.unpack_from("<Q", data, 16)[0]
    doc = json.loads(data[32:32 + hlen])
    edit(doc)
    body = json.dumps(doc, separators=(",", ":")).encode()
    room = min(e["offset"] for e in doc["entries"]) - 32  # the header area, up to the first entry's data
    assert len(body) <= room
    data[16:24] = struct.pack("<Q", len(body))
    data[24:28] = struct.pack("<I", zlib.crc32(body))
    data[32:32 + room] = body + b"\0" * (room - len(body))
    path.write_bytes(bytes(data))


def test_open_takes_an_agreeing_header_without_decoding_it(tmp_path) -> None:
    sd = {"w": torch.arange(6, dtype=torch.float32), "b": torch.ones(3, dtype=torch.bfloat16), "w2": None}
    sd["w2"] = sd["w"]  # a tied alias
    mmapckpt.save(sd, tmp_path / "ck")
    with mmapckpt.open(tmp_path / "ck") as ck:
        shards = list(ck._files.shards.values())
        assert torch.equal(ck.get_tensor("w"), sd["w"]) and torch.equal(ck.get_tensor("b"), sd["b"])
    assert shards and all(s._agreed is not None for s in shards)
    assert all("_decoded" not in vars(s) for s in shards), "an agreeing header is never json-decoded"


def _past(doc, fqn: str) -> int:
    """The first aligned offset after entry ``fqn``'s data."""
    (e,) = [e for e in doc["entries"] if e["fqn"] == fqn]
    return -(-(e["offset"] + e["length"]) // 64) * 64


@pytest.mark.parametrize("edit, words", [
    (lambda e, doc: e.__setitem__("dtype", "int32"), "shard holds int32 but the metadata says float32"),
    (lambda e, doc: e.__setitem__("shape", [3, 2]), "stored chunk is [3, 2], the metadata says [2, 3]"),
    (lambda e, doc: e.__setitem__("offset", _past(doc, "pad")), "but the shard header says"),
])
def test_a_header_that_disagrees_with_the_metadata_is_refused(tmp_path, edit, words) -> None:
    """A consistent, checksummed header (in the writer's spelling) that places an entry otherwise than the
    metadata: the fast path must not take it, and the per-entry check names the difference."""
    mmapckpt.save({"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "pad": torch.zeros(2000)}, tmp_path / "ck")
    (shard,) = (tmp_path / "ck").glob("*.distcp")

    def one(doc) -> None:
        (w,) = [e for e in doc["entries"] if e["fqn"] == "w"]
        edit(w, doc)

    _rewrite_compact(shard, one)
    with pytest.raises(mmapckpt.CheckpointError, match=words.replace("[", r"\[").replace("]", r"\]")) as ei:
        with mmapckpt.open(tmp_path / "ck") as ck:
            ck.get_tensor("w")
    assert "'w" in str(ei.value) and shard.name in str(ei.value)
