"""Test data and instruments of the object-store tests (imported by the tests and by their spawned ranks).

``state_dict()`` holds every kind of value a round trip must keep bit for bit: bf16, fp8,
NaN payloads, -0.0, bool, complex, an empty tensor, and tensors big enough for several
ranged GETs and multipart parts at the small sizes the tests set. ``GetCounter`` counts
the GET requests and bytes that mmapckpt's own S3 client sends, by botocore's event
hooks on that (shared, cached) client: what the store was asked for, not what a reader
says it took.
"""

from __future__ import annotations

import threading
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

#: name -> (shape, dtype)
TENSORS: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
    "emb": ((300, 96), torch.bfloat16),
    "proj": ((7, 1000), torch.float32),
    "big": ((3 << 20,), torch.float32),  # 12 MiB: several parts and ranged GETs at the tests' sizes
    "fp8a": ((33, 5), torch.float8_e4m3fn),
    "fp8b": ((17,), torch.float8_e5m2),
    "ids": ((123,), torch.int64),
    "mask": ((9, 3), torch.bool),
    "cplx": ((4, 4), torch.complex64),
    "half": ((50,), torch.float16),
    "empty": ((0, 7), torch.float32),
}
#: 1 MiB GETs and 5 MiB parts (S3's least), so that a small state dict exercises multipart uploads and split reads.
SMALL_PARTS = {"part_size": 1 << 20, "upload_part_size": 5 << 20}


def tensor(name: str, salt: int = 0) -> torch.Tensor:
    """Seeded random bytes viewed as the entry's dtype, with -0.0 and NaNs of full payload planted."""
    shape, dtype = TENSORS[name]
    numel = 1
    for s in shape:
        numel *= s
    size = torch.empty((), dtype=dtype).element_size()
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()) + salt)
    raw = torch.randint(0, 256, (numel * size,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw &= 1
    elif dtype.is_floating_point and numel:
        specials = (bytes(size - 1) + b"\x80", b"\xff" * size, b"\xff" * (size - 1) + b"\x7f")
        for j, i in enumerate(range(0, min(numel, 60), 7)):
            raw[i * size:(i + 1) * size] = torch.frombuffer(bytearray(specials[j % 3]), dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)


def state_dict(salt: int = 0) -> dict[str, torch.Tensor]:
    return {n: tensor(n, salt) for n in TENSORS}


def complement(t: torch.Tensor) -> torch.Tensor:
    """Same dtype and shape, every byte different: a load target whose unwritten bytes show."""
    if t.dtype == torch.bool:
        return ~t
    return (t.contiguous().reshape(-1).view(torch.uint8) ^ 0xFF).view(t.dtype).reshape(t.shape)


def raw(t: torch.Tensor) -> bytes:
    t = t.detach().contiguous()
    return t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def assert_same(got: dict[str, Any], want: dict[str, torch.Tensor], what: str = "") -> None:
    assert set(got) >= set(want), f"{what}: missing {sorted(set(want) - set(got))}"
    for n, t in want.items():
        g = got[n]
        assert g.dtype == t.dtype and tuple(g.shape) == tuple(t.shape), f"{what}{n}: {g.dtype} {tuple(g.shape)}"
        assert raw(g) == raw(t), f"{what}{n}: bytes differ"


class GetCounter:
    """GET requests and requested bytes of mmapckpt's S3 client for the current environment, while installed."""

    def __init__(self, options: dict[str, Any] | None = None) -> None:
        from mmapckpt.storage.s3.options import S3Options, client_for
        self.client = client_for(S3Options.of(options))
        self.requests = 0
        self.bytes = 0
        self.ranges: list[tuple[str, int, int]] = []
        # the reader's threads call _count at once: `+=` on an attribute is no atomic step (a run lost two of
        # twelve 1 MiB ranges' counts and failed the bytes check with every byte loaded)
        self._mutex = threading.Lock()

    def _count(self, params: dict[str, Any], **_: Any) -> None:
        rng = params.get("Range")
        with self._mutex:
            self.requests += 1
            if rng:
                a, b = rng.removeprefix("bytes=").split("-")
                self.bytes += int(b) - int(a) + 1
                self.ranges.append((params["Key"], int(a), int(b) + 1))

    def __enter__(self) -> GetCounter:
        self.client.meta.events.register("provide-client-params.s3.GetObject", self._count)
        return self

    def __exit__(self, *exc: object) -> None:
        self.client.meta.events.unregister("provide-client-params.s3.GetObject", self._count)


@contextmanager
def s3_operations() -> Iterator[list[str]]:
    """The S3 operations mmapckpt's own client makes meanwhile, in order (HeadObject, ListObjectsV2, GetObject, ...)."""
    from mmapckpt.storage.s3.options import S3Options, client_for

    client = client_for(S3Options.of(None))
    ops: list[str] = []

    def count(event_name: str, **_: object) -> None:
        ops.append(event_name.rsplit(".", 1)[-1])
    client.meta.events.register("provide-client-params.s3", count)
    try:
        yield ops
    finally:
        client.meta.events.unregister("provide-client-params.s3", count)
