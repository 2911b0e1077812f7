"""Ranged GETs of one S3 object version straight into the callers' buffers (``storage/ranged.py``).

Every GET is conditional on the ETag the object had when it was opened (``If-Match``): an object replaced
meanwhile answers 412 and the read fails, never mixing two versions. botocore retries a request that fails; the
body (read into the buffers themselves) and a body that breaks off are ``storage/ranged.py``'s.
"""

from __future__ import annotations

from typing import Any, Callable

from ...errors import CheckpointError
from ..ranged import Fetch, RangedReads, plan_requests, replaced_while_read
from .failures import FAILURES, is_missing, is_precondition_failed, storage_error
from .options import S3Options

__all__ = ["Fetch", "ObjectReads", "plan_requests"]


class ObjectReads(RangedReads):
    """Ranged reads of one object version (``etag``) of ``size`` bytes (planned and run by ``RangedReads.read``)."""

    pool_name = "s3"
    failures = FAILURES

    def __init__(self, client: Any, bucket: str, key: str, etag: str | None, size: int, url: str,
                 opts: S3Options, on_fetch: Callable[[int, int], None] | None = None) -> None:
        super().__init__(size, url, opts.part_size, opts.concurrency, on_fetch, retries=opts.retries)
        self.client, self.bucket, self.key, self.etag, self.opts = client, bucket, key, etag, opts

    def _open(self, start: int, length: int, entry: str | None) -> Any:
        kwargs = {"IfMatch": self.etag} if self.etag else {}
        try:
            resp = self.client.get_object(Bucket=self.bucket, Key=self.key,
                                          Range=f"bytes={start}-{start + length - 1}", **kwargs)
        except CheckpointError:
            raise
        except Exception as e:
            if is_precondition_failed(e):
                raise replaced_while_read("object", self.url, entry) from None
            if is_missing(e):
                raise replaced_while_read("object", self.url, entry, "removed") from None
            raise storage_error(e, self.url, what="reading", entry=entry) from e
        return resp["Body"]._raw_stream  # botocore's StreamingBody over urllib3's response
