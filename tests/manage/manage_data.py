"""The data of the managed-root tests (imported by the tests and by the processes they start).

``state(step)`` is a small state dict whose every byte depends on the step (seeded random bytes
viewed as float32 and bfloat16, NaN payloads included, and the step as a non-tensor), so any
process can recompute what step N must load as, bit for bit.
"""

from __future__ import annotations

import os
from typing import Any

import torch


def state(step: int, numel: int = 4096) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1000 + step)
    return {
        "model.w": torch.randint(0, 256, (numel * 4,), dtype=torch.uint8, generator=g).view(torch.float32),
        "model.emb": torch.randint(0, 256, (33 * 7 * 2,), dtype=torch.uint8, generator=g).view(torch.bfloat16)
                     .reshape(33, 7),
        "step": step,
    }


def blank(numel: int = 4096) -> dict[str, Any]:
    """Load targets: the bitwise complement of nothing in particular (every byte a load fails to write shows)."""
    return {"model.w": torch.full((numel,), -7.0), "model.emb": torch.full((33, 7), 3.0, dtype=torch.bfloat16),
            "step": -1}


def same(got: dict[str, Any], want: dict[str, Any]) -> bool:
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            g = got[k]
            if g.shape != v.shape or g.dtype != v.dtype or not torch.equal(g.contiguous().view(torch.uint8),
                                                                         v.contiguous().view(torch.uint8)):
                return False
        elif got[k] != v:
            return False
    return True


def s3_options(server: Any) -> dict[str, str]:
    """storage_options reaching the test radosgw (no AWS_* environment needed)."""
    return {"endpoint_url": server.endpoint_url, "key": server.access_key, "secret": server.secret_key,
            "region_name": server.region}


def stored_files(root: str, client: Any = None) -> dict[str, int]:
    """Every file under ``root`` (root-relative, ``/``-separated) with its size, read without mmapckpt."""
    if root.startswith("s3://"):
        bucket, _, prefix = root[5:].partition("/")
        out = {}
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/"):
            for o in page.get("Contents", ()):
                out[o["Key"][len(prefix) + 1:]] = o["Size"]
        return out
    out = {}
    for d, _, files in os.walk(root):
        for f in files:
            p = os.path.join(d, f)
            out[os.path.relpath(p, root).replace(os.sep, "/")] = os.path.getsize(p)
    return out


def uploads_in_progress(root: str, client: Any = None) -> list[str]:
    if not root.startswith("s3://"):
        return []
    bucket, _, prefix = root[5:].partition("/")
    return [u["Key"] for u in client.list_multipart_uploads(Bucket=bucket, Prefix=prefix + "/").get("Uploads", [])]
