"""Coverage-guided fuzzing of the shard and metadata parsers with atheris (not run by CI).

    pip install atheris
    python fuzz/fuzz_parsers.py -max_total_time=120 -rss_limit_mb=2048

The first input byte picks a parser: the shard preamble and header
(``format.decode_preamble`` + ``format.decode_header``, the bytes taken as a whole
file), the mmapckpt ``.metadata`` codec, the restricted unpickler for stock DCP
metadata, or one of the first two with the CRC recomputed (so that mutations get
past the checksum to the JSON validation). The corpus starts from real files written by MmapWriter and FileSystemWriter.
Any exception other than ``CheckpointError`` is a finding (atheris stops and saves
the input as ``crash-*``).
"""

from __future__ import annotations

import os
import sys
import tempfile
import warnings
import zlib

import atheris
import torch  # noqa: F401  (imported first, so that only mmapckpt is instrumented below)
import torch.distributed.checkpoint  # noqa: F401

with atheris.instrument_imports(include=["mmapckpt"]):
    from mmapckpt.format import layout as fmt
    from mmapckpt.format.metadata import stock as _stockmeta
    from mmapckpt.format import metadata as metafile
    from mmapckpt.errors import CheckpointError


def _parse_shard(data: bytes) -> None:
    minor, order, hlen, hcrc = fmt.decode_preamble(data[: fmt.PREAMBLE_SIZE], len(data), "fuzz")
    body = data[fmt.PREAMBLE_SIZE:fmt.PREAMBLE_SIZE + hlen]
    fmt.decode_header(body, header_crc=hcrc, byte_order=order, minor=minor, file_size=len(data), path="fuzz")


def _parse_metadata(data: bytes) -> None:
    metafile.decode_metadata(data, "fuzz")


def _parse_stock(data: bytes) -> None:
    _stockmeta.decode_stock(data, "fuzz")


def _parse_shard_valid_crc(data: bytes) -> None:
    """The header CRC recomputed, so that mutations reach the JSON validation."""
    if len(data) >= fmt.PREAMBLE_SIZE:
        hlen = int.from_bytes(data[16:24], "little")
        body = data[fmt.PREAMBLE_SIZE:fmt.PREAMBLE_SIZE + hlen]
        data = data[:24] + zlib.crc32(body).to_bytes(4, "little") + data[28:]
    _parse_shard(data)


def _parse_metadata_valid_crc(data: bytes) -> None:
    if len(data) >= 24:
        body = data[24:]
        data = data[:12] + zlib.crc32(body).to_bytes(4, "little") + len(body).to_bytes(8, "little") + body
    _parse_metadata(data)


PARSERS = (_parse_shard, _parse_metadata, _parse_stock, _parse_shard_valid_crc, _parse_metadata_valid_crc)


def test_one_input(data: bytes) -> None:
    if not data:
        return
    try:
        PARSERS[data[0] % len(PARSERS)](data[1:])
    except CheckpointError:
        pass


def _seed_corpus(directory: str) -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    from mmapckpt import MmapWriter

    warnings.simplefilter("ignore")
    sd = {"w": torch.randn(4, 4), "b": torch.zeros(3, dtype=torch.bfloat16), "e": torch.zeros(0, 2), "x": {"k": 1}}
    with tempfile.TemporaryDirectory() as tmp:
        dcp.save(sd, storage_writer=MmapWriter(os.path.join(tmp, "m"), alignment=64), no_dist=True)
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(os.path.join(tmp, "s")), no_dist=True)
        files = [(0, os.path.join(tmp, "m", "__0_0.distcp")), (1, os.path.join(tmp, "m", ".metadata")),
                 (2, os.path.join(tmp, "s", ".metadata")), (3, os.path.join(tmp, "m", "__0_0.distcp")),
                 (4, os.path.join(tmp, "m", ".metadata"))]
        for tag, path in files:
            with open(path, "rb") as f:
                data = bytes([tag]) + f.read()
            with open(os.path.join(directory, f"seed-{tag}"), "wb") as f:
                f.write(data)


if __name__ == "__main__":
    corpus = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus")
    os.makedirs(corpus, exist_ok=True)
    if not os.listdir(corpus):
        _seed_corpus(corpus)
    atheris.Setup([sys.argv[0], *sys.argv[1:], corpus], test_one_input)
    atheris.Fuzz()
