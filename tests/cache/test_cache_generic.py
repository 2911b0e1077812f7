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
