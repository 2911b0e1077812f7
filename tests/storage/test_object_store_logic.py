"""The object store's logic that needs no server: request planning, part sizes, options, regions of unmapped files.

- ``plan_requests`` (storage/s3/reads.py): every byte of every read is covered exactly once by the
  requests, in the right buffer; no request is longer than the part size; neighbours are joined
  (property test over random batches); a run is cut at bytes into full requests; a batch of more parts than
  threads is one request per thread, the padding between its tensors adding none.
- ``part_size_for`` (storage/s3/uploads.py): at least 5 MiB, at most 10,000 parts for any size.
- ``S3Options.of``: s3fs's names and aliases, unknown keys refused, S3's 5 MiB part minimum.
- ``FetchReads.materialize`` (reading/fetches.py): any basic-indexing view of a placeholder reads
  exactly the bytes of its elements (strided ones as their contiguous runs) and gives the values
  of the same view of the real tensor.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mmapckpt import CheckpointError
from mmapckpt.reading.fetches import FetchReads, placeholder
from mmapckpt.storage.ranged import RangedReads
from mmapckpt.storage.s3.options import MAX_PARTS, MIN_PART, S3Options, parse_url
from mmapckpt.storage.s3.reads import plan_requests
from mmapckpt.storage.s3.uploads import part_size_for

# ---------------------------------------------------------------------------- request planning

_reads = st.lists(st.tuples(st.integers(0, 5000), st.integers(0, 700)), min_size=1, max_size=25)


@settings(max_examples=300, deadline=None)
@given(_reads, st.integers(1, 900), st.integers(0, 300))
def test_requests_cover_every_byte_once_in_its_buffer(reads: list[tuple[int, int]], part: int, gap: int) -> None:
    data = bytes((i * 7 + 3) % 251 for i in range(6000))
    bufs = [bytearray(n) for _, n in reads]
    requests = plan_requests([(o, b) for (o, _), b in zip(reads, bufs)], part, gap)
    for start, segments in requests:  # serve each request as the store would: its bytes in order
        length = sum(s if isinstance(s, int) else len(s) for s in segments)
        assert length <= part, "a request longer than the part size"
        assert all(isinstance(s, int) and 0 < s <= gap or not isinstance(s, int) for s in segments)
        pos = start
        for s in segments:
            if isinstance(s, int):
                pos += s
            else:
                s[:] = data[pos:pos + len(s)]
                pos += len(s)
    for (o, n), b in zip(reads, bufs):
        assert bytes(b) == data[o:o + n]
    nonempty = [(o, n) for o, n in reads if n]
    assert sum(len(s) for _, segs in requests for s in segs if not isinstance(s, int)) == sum(n for _, n in nonempty)


def test_neighbours_join_and_long_reads_split() -> None:
    a, b, c = bytearray(100), bytearray(100), bytearray(2500)
    requests = plan_requests([(0, a), (150, b), (10_000, c)], part_size=1000, gap=64)
    assert [(s, [x if isinstance(x, int) else len(x) for x in segs]) for s, segs in requests] == [
        (0, [100, 50, 100]), (10_000, [1000]), (11_000, [1000]), (12_000, [500])]
    assert len(plan_requests([(0, a), (300, b)], part_size=1000, gap=64)) == 2  # too far apart


def test_a_run_is_cut_at_bytes_into_full_requests() -> None:
    """A run of neighbouring reads becomes requests of exactly the part size (the last shorter), a read split where a
    cut falls in it and a gap where one falls in it not asked for. Joining only whole reads made three 600-byte
    neighbours three requests of a 1000-byte part."""
    bufs = [bytearray(600) for _ in range(3)]
    requests = plan_requests([(i * 600, b) for i, b in enumerate(bufs)], part_size=1000, gap=64)
    assert [(s, [len(x) for x in segs]) for s, segs in requests] == [(0, [600, 400]), (1000, [200, 600])]
    a, b = bytearray(990), bytearray(500)  # the cut falls in the 30-byte gap between them: the gap is dropped
    requests = plan_requests([(0, a), (1020, b)], part_size=1000, gap=64)
    assert [(s, [x if isinstance(x, int) else len(x) for x in segs]) for s, segs in requests] == [(0, [990]),
                                                                                                (1020, [500])]


class _Memory(RangedReads):
    """Ranged reads of an object held in memory, each request's length recorded."""

    def __init__(self, data: bytes, part_size: int, concurrency: int) -> None:
        super().__init__(len(data), "mem://x", part_size, concurrency)
        self.data, self.lengths = data, []

    def _open(self, start: int, length: int, entry: str | None) -> Any:
        import io

        import urllib3
        self.lengths.append(length)
        return urllib3.HTTPResponse(io.BytesIO(self.data[start:start + length]), preload_content=False,
                                    headers={"content-length": str(length)})


@pytest.mark.parametrize("size, concurrency, lengths", [
    (64 << 10, 4, [16 << 10] * 4),  # 16 parts of 4 KiB: one request per thread
    (64 << 10, 2, [16 << 10] * 4),  # a thread's share (32 KiB) is more than 4 parts: 4 parts each
    (8 << 10, 4, [4 << 10] * 2),  # fewer parts than threads: part_size
    (56 << 10, 4, [14 << 10] * 4),  # a share between one part and four
])
def test_a_large_batch_is_one_request_per_thread(size: int, concurrency: int, lengths: list[int]) -> None:
    """Fewer, longer GETs where a batch holds more parts than there are threads (storage/ranged.py request_size),
    every byte still in its buffer; without request_size a 64 KiB batch of 4 KiB parts was 16 requests."""
    data = bytes((i * 13 + 5) % 251 for i in range(size + 100))
    reads = _Memory(data, part_size=4 << 10, concurrency=concurrency)
    bufs = [bytearray(size // 2), bytearray(size - size // 2)]  # two neighbouring tensors
    reads.read([(100, bufs[0]), (100 + size // 2, bufs[1])])
    assert sorted(reads.lengths, reverse=True) == lengths
    assert bytes(bufs[0] + bufs[1]) == data[100:100 + size]


def test_padding_between_tensors_does_not_add_a_request() -> None:
    """A batch's request size counts the gaps it joins (``requested_bytes``): 16 tensors of 1000 bytes 24 bytes apart
    (alignment padding) over 4 threads are 4 requests, not 4 and a short fifth for the padding's bytes."""
    data = bytes((i * 13 + 5) % 251 for i in range(20_000))
    reads = _Memory(data, part_size=2000, concurrency=4)  # a thread's share: 4090 bytes, about 2 parts
    bufs = [bytearray(1000) for _ in range(16)]
    reads.read([(i * 1024, b) for i, b in enumerate(bufs)])
    assert len(reads.lengths) == 4
    assert all(bytes(b) == data[i * 1024:i * 1024 + 1000] for i, b in enumerate(bufs))


# ---------------------------------------------------------------------------- uploads and options
@pytest.mark.parametrize("size", [None, 0, 1, MIN_PART, 16 << 20, 160 << 30, 5 << 40])
def test_part_sizes_respect_s3_bounds(size: int | None) -> None:
    part = part_size_for(size, 16 << 20)
    assert part >= MIN_PART
    if size:
        assert -(-size // part) <= MAX_PARTS


def test_options_take_s3fs_names_and_refuse_the_unknown() -> None:
    o = S3Options.of({"aws_access_key_id": "k", "secret": "s", "client_kwargs": {"endpoint_url": "http://x:1"},
                      "region": "eu-west-1", "part_size": 1 << 20})
    assert (o.key, o.secret, o.endpoint_url, o.region_name, o.part_size) == ("k", "s", "http://x:1", "eu-west-1",
                                                                               1 << 20)
    with pytest.raises(CheckpointError, match=r"unknown option\(s\) \['secrett'\]"):
        S3Options.of({"secrett": "x"})
    with pytest.raises(CheckpointError, match="at least 5242880 bytes"):
        S3Options.of({"upload_part_size": 1 << 20})
    assert parse_url("s3://b/a/b/") == ("b", "a/b") and parse_url("s3://b") == ("b", "")
    with pytest.raises(CheckpointError, match="needs a bucket"):
        parse_url("s3:///x")


# ---------------------------------------------------------------------------- regions of an unmapped file
class _File:
    """A file held in memory that counts the bytes read from it (the StoredFile reads FetchReads uses)."""

    def __init__(self, data: bytes) -> None:
        self.data, self.size, self.read_bytes = data, len(data), 0

    def read_into(self, offset: int, buf: Any, *, entry: str | None = None) -> None:
        mv = memoryview(buf).cast("B")
        mv[:] = self.data[offset:offset + len(mv)]
        self.read_bytes += len(mv)

    def read_batch(self, fetches: list[tuple[int, Any]], *, entry: str | None = None) -> None:
        for o, b in fetches:
            self.read_into(o, b)


def _index(draw: Any, shape: tuple[int, ...]) -> tuple[Any, ...]:
    out = []
    for n in shape:
        if draw(st.booleans()):
            out.append(draw(st.integers(0, n - 1)))
        else:
            a = draw(st.integers(0, n))
            out.append(slice(a, draw(st.integers(a, n)), draw(st.integers(1, 3))))
    return tuple(out)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_a_view_of_a_placeholder_reads_exactly_its_elements(data: Any) -> None:
    shape = tuple(data.draw(st.lists(st.integers(1, 6), min_size=1, max_size=4)))
    dtype = data.draw(st.sampled_from([torch.float32, torch.bfloat16, torch.int64, torch.uint8]))
    t = torch.arange(torch.Size(shape).numel(), dtype=torch.int64).to(dtype).reshape(shape)
    f = _File(bytes(512) + t.reshape(-1).view(torch.uint8).numpy().tobytes())
    index = _index(data.draw, shape)
    got = FetchReads(f).materialize(placeholder(512, dtype, shape)[index])  # type: ignore[arg-type]
    want = t[index]
    assert got.shape == want.shape and torch.equal(got, want)
    assert f.read_bytes == want.numel() * want.element_size()
