"""The format's two additions for chunks stored once: the shard entries' ``blake3`` key (2.7) and the
metadata's cross-step references (3.4), as docs/format.md specifies them."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from mmapckpt.errors import UnsafePathError
from mmapckpt.format import layout as fmt
from mmapckpt.format.entries import SaveId, reference_parts, safe_relative_path
from mmapckpt.format.metadata import framing

DOC = Path(__file__).resolve().parents[2] / "docs" / "format.md"


def _entries() -> list[fmt.Entry]:
    plan = fmt.plan_shard([fmt.EntrySpec("w", (0,), "tensor", "float32", (16,), 64),
                           fmt.EntrySpec("s", None, "bytes", None, (), 3)], hashed=True)  # room for the hashes
    entries = plan.entries
    return [e._replace(crc32=0x1234) for e in entries]


def test_hashes_are_an_optional_key_that_a_plain_header_lacks_and_readers_ignore() -> None:
    entries = _entries()
    plain = fmt.encode_header(entries, "sid")
    hashed = fmt.encode_header(entries, "sid", [("ab" * 32, 0xfeed), None])
    assert b"blake3" not in plain and hashed.count(b'"blake3":"' + b"ab" * 32 + b'"') == 1
    minor, order, hlen, hcrc = fmt.decode_preamble(hashed[:32], len(hashed) + 4096, "f")
    assert (minor, fmt.decode_preamble(plain[:32], len(plain) + 4096, "f")[0]) == (fmt.FORMAT_MINOR_HASHES, 0)
    body = hashed[32:32 + hlen]
    header = fmt.decode_header(body, header_crc=hcrc, byte_order=order, minor=minor, file_size=1 << 20, path="f")
    assert [e[:8] for e in header.entries] == [e[:8] for e in entries]
    doc, _ = fmt.decode_header_doc(body, header_crc=hcrc, path="f")
    assert fmt.entry_hashes(doc) == {("w", (0,)): ("ab" * 32, entries[0].offset, 0xfeed)}
    # a header with hashes still agrees with the metadata's records (the loaders' quick check)
    records = [(e.fqn, e.chunk_offsets, e.kind, e.dtype, e.shape, e.offset, e.length) for e in entries]
    assert fmt.header_crcs(body, "sid", records) == [0x1234, 0x1234]


def test_a_malformed_hash_is_not_one_to_compare_with() -> None:
    doc = {"entries": [{"fqn": "w", "kind": "tensor", "chunk_offsets": [0], "offset": 64, "blake3": "AB" * 32},
                       {"fqn": "v", "kind": "tensor", "chunk_offsets": [0], "offset": 128, "blake3": "ab" * 31}]}
    assert fmt.entry_hashes(doc) == {}


@pytest.mark.parametrize("name", ["../step-1/__0_0.distcp", "../step-0/x", "../step-12345/__3_1.abcdef01.distcp"])
def test_the_reference_form(name: str) -> None:
    assert reference_parts(name) is not None
    assert safe_relative_path(name, "m", {name: "sid"}) == name


@pytest.mark.parametrize("name", ["../../x", "../step-1/../../x", "../step-1/a/b", "../step-01/x", "../step-/x",
                                  "../stepx-1/x", "../step-1/..", "../step-1/", "/abs/x", "..\\step-1\\x"])
def test_other_names_leave_the_checkpoint_even_when_listed(name: str) -> None:
    assert reference_parts(name) is None
    with pytest.raises(UnsafePathError):
        safe_relative_path(name, "m", {name: "sid"})


def test_a_reference_not_listed_is_refused() -> None:
    with pytest.raises(UnsafePathError):
        safe_relative_path("../step-1/x", "m", {"../step-2/x": "sid"})


def test_a_save_id_carries_its_references_through_pickle() -> None:
    sid = SaveId("me", {"../step-1/f": "them"})
    back = pickle.loads(pickle.dumps(sid))
    assert back == "me" and back.references == {"../step-1/f": "them"}
    assert back.of("../step-1/f") == "them" and back.of("__0_0.distcp") == "me" and back.of("../step-2/f") is None


def test_the_spec_names_both_additions() -> None:
    text = DOC.read_text()
    assert f"version {fmt.FORMAT_MAJOR}.{fmt.FORMAT_MINOR_HASHES}" in text.splitlines()[0]
    assert f"| `{fmt.HASH_KEY}` | tensor, MAY be absent |" in text
    assert f"| `{fmt.HEAD_KEY}` | tensor with `blake3`, MAY be absent |" in text and str(fmt.HEAD_BYTES) in text
    assert f"Metadata file {framing.META_MAJOR}.{framing.META_MINOR_REFS}" in text
    assert ".mmapckpt-root" in text and "### 3.4 Managed roots and cross-step references" in text
