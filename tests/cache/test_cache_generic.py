"""The cache over a medium with no listing of versions and no HEAD (``unmapped://``, tests/unmapped.py): each file's
version is what opening it says (its size and identity), and the rest is as on S3. No server needed."""

from __future__ import annotations

import torch
from unmapped import medium, url  # noqa: F401  (medium: the unmapped:// fixture)

import mmapckpt
from mmapckpt.storage.cache import CachedStorage
from mmapckpt.storage.location import storage_for


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert set(a) == set(b) and all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)


def test_a_medium_without_versions_is_cached_by_what_opening_says(medium, tmp_path):  # noqa: F811
    sd = {"a": torch.randn(64, 33), "b": torch.arange(1000, dtype=torch.int16)}
    mmapckpt.save(sd, tmp_path / "ck")
    u, opts = url(tmp_path / "ck"), {"cache_dir": str(tmp_path / "cache")}
    assert isinstance(storage_for(u, options=opts), CachedStorage)
    _same(mmapckpt.load(u, storage_options=opts), sd)
    fetched = medium[0]
    assert fetched > sum(t.nbytes for t in sd.values())
    _same(mmapckpt.load(u, storage_options=opts), sd)
    assert medium[0] == fetched  # served from the copies: nothing read through the medium
    sd2 = {k: v + 1 for k, v in sd.items()}
    mmapckpt.save(sd2, tmp_path / "ck")  # a new save: new files (new inodes: new versions)
    _same(mmapckpt.load(u, storage_options=opts), sd2)
    assert medium[0] > fetched


def test_crcs_computed_window_by_window_in_any_threads_match_the_header(tmp_path):
    """check.py: each window's CRC-32s computed on their own (``Checker.part``, in the fetch's threads) and combined
    in order (``crc32_combine``) equal the header's, whatever the window size; a flipped byte is caught."""
    import random
    import zlib

    import pytest

    from mmapckpt.errors import ChecksumError
    from mmapckpt.storage.cache.check import CRC32, Checker, crc32_combine

    rng = random.Random(5)
    for _ in range(200):
        a, b = rng.randbytes(rng.randrange(0, 5000)), rng.randbytes(rng.randrange(0, 5000))
        assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)
    sd = {f"t{i}": torch.randn(rng.randrange(1, 3000)) for i in range(12)}
    mmapckpt.save(sd, tmp_path / "ck")
    data = bytearray((tmp_path / "ck" / "__0_0.distcp").read_bytes())

    def check(data: bytearray, window: int) -> str:
        c = Checker("ck/__0_0.distcp", len(data))
        head = c.needs(data[:64])
        head = max(head, c.needs(data[:head]))
        c.start(memoryview(data)[:head])
        for o in range(head, len(data), window):
            c.add(c.part(o, memoryview(data)[o:o + window]))
        return c.finish()
    for window in (1, 7, 4096, 10_000, len(data)):
        assert check(data, window) == CRC32
    probe = Checker("ck/__0_0.distcp", len(data))
    probe.start(data)
    last = probe.entries[-1]
    data[last.offset + last.length - 1] ^= 1  # the last byte of the last entry
    with pytest.raises(ChecksumError):
        check(data, 4096)


def test_a_medium_without_listings_is_asked_one_look_per_warm_load(medium, tmp_path):  # noqa: F811
    """listing.py on a medium with no listing of versions: the versions found file by file are recorded with an
    mmapckpt commit's version, so a warm load opens only ``.metadata`` on the medium; a new save is found by it;
    a stock DCP commit is not trusted (each file looked at)."""
    from unmapped import SCHEME, Unmapped

    from mmapckpt.storage.location import register_scheme

    opened: list[str] = []

    class Counting(Unmapped):
        def open_file(self, name):  # type: ignore[no-untyped-def]
            opened.append(name)
            return super().open_file(name)
    register_scheme(SCHEME, Counting)
    sd = {"a": torch.randn(64, 33), "b": torch.arange(1000, dtype=torch.int16)}
    mmapckpt.save(sd, tmp_path / "ck")
    u, opts = url(tmp_path / "ck"), {"cache_dir": str(tmp_path / "cache")}
    _same(mmapckpt.load(u, storage_options=opts), sd)
    assert "__0_0.distcp" in opened
    for _ in range(2):
        opened.clear()
        _same(mmapckpt.load(u, storage_options=opts), sd)
        assert opened == [".metadata"], opened  # one look: the commit's version
    sd2 = {k: v + 1 for k, v in sd.items()}
    mmapckpt.save(sd2, tmp_path / "ck")  # a new commit: its shard looked at (and fetched) again
    opened.clear()
    _same(mmapckpt.load(u, storage_options=opts), sd2)
    assert any(n.endswith(".distcp") for n in opened), opened
    opened.clear()
    _same(mmapckpt.load(u, storage_options=opts), sd2)
    assert opened == [".metadata"], opened

    mmapckpt.convert(tmp_path / "ck", tmp_path / "dcp", to="dcp")
    d = url(tmp_path / "dcp")
    for _ in range(2):
        opened.clear()
        _same(mmapckpt.load(d, storage_options=opts), sd2)
        assert any(n.endswith(".distcp") for n in opened), opened  # a stock DCP commit vouches for nothing
