"""A shard written to S3: a multipart upload streamed from the tensors' bytes (the part bookkeeping every
store shares: ``storage/parts.py``).

The shard writer hands pieces at ascending offsets and the head (offset 0) last. Pieces are
gathered into parts of ``upload_part_size`` bytes (at least 5 MiB, as S3 requires of every
part but the last; larger where the shard would need more than 10,000 parts) and each full
part is uploaded at once, at most ``upload_concurrency`` parts in flight, so memory stays
within ``(upload_concurrency + 2) * upload_part_size`` whatever the shard's size. The first
part, which holds the head, is as small as S3 allows (5 MiB, or the head's size), kept until
:meth:`S3Output.finish` and uploaded last; part numbers, not upload order, place parts in the
object. A shard smaller than one part is one
PUT. The object appears under its name only when the upload completes: a save that fails
aborts its upload, and a save killed before completing leaves an incomplete upload that the
next save to the location aborts (``S3Storage.remove``), never an object.
"""

from __future__ import annotations

from typing import Any

from ..parts import PartedOutput
from ..parts import part_size_for as _part_size_for
from .failures import FAILURES
from .options import MAX_PARTS, MIN_PART, S3Options

__all__ = ["S3Output", "part_size_for"]


def part_size_for(size: int | None, wanted: int) -> int:
    """The part size for an object of ``size`` bytes: ``wanted`` (at least 5 MiB), raised (in MiB steps) to fit in
    10,000 parts."""
    return _part_size_for(size, wanted, MAX_PARTS, MIN_PART)


class S3Output(PartedOutput):
    """Shard ``key`` being written (see the module docstring)."""

    how = "multipart"
    failures = FAILURES
    thread_name = "mmapckpt-s3-put"

    def __init__(self, client: Any, bucket: str, key: str, url: str, size: int | None, *, head: int,
                 opts: S3Options) -> None:
        super().__init__(url, size, start=0, part_size=part_size_for(size, opts.upload_part_size),
                         concurrency=opts.upload_concurrency)
        self.client, self.bucket, self.key, self.head, self.opts = client, bucket, key, head, opts
        # part 1 holds the head and is uploaded last: as small as S3 allows (and the head needs), so
        # that the upload after the last piece is short
        self.first_size = max(MIN_PART, -(-head // (1 << 20)) << 20)
        self._number = 1  # the number of the part being gathered
        self._first: bytearray | None = None  # part 1 (holds the head), uploaded by finish()
        self._upload_id: str | None = None

    # ------------------------------------------------------------------ the parts
    def _cap(self) -> int:
        return self.first_size if self._number == 1 else self.part_size

    def _full(self, buf: bytearray) -> None:
        number, self._number = self._number, self._number + 1
        if number == 1:
            self._first = buf
            return
        self._upload(number, buf)

    def _upload(self, number: int, buf: bytearray) -> None:
        if self._upload_id is None:
            try:
                self._upload_id = self.client.create_multipart_upload(Bucket=self.bucket, Key=self.key)["UploadId"]
            except Exception as e:
                raise self._error(e, "starting the upload") from e
        self._submit(self._put_part, number, buf)

    def _put_part(self, number: int, buf: bytearray) -> dict[str, Any]:
        try:
            r = self.client.upload_part(Bucket=self.bucket, Key=self.key, UploadId=self._upload_id,
                                        PartNumber=number, Body=buf)
        except Exception as e:
            raise self._error(e, f"uploading part {number}") from e
        return {"PartNumber": number, "ETag": r["ETag"]}

    # ------------------------------------------------------------------ the end
    def finish(self, head: bytes) -> None:
        self._pad_to_size()
        first = self._first if self._first is not None else self._buf
        if len(head) > len(first):
            raise ValueError(f"head of {len(head)} bytes is longer than the first part ({len(first)})")
        first[:len(head)] = head
        if self._first is None:  # the whole object is one part: one PUT
            try:
                self.client.put_object(Bucket=self.bucket, Key=self.key, Body=first)
            except Exception as e:
                raise self._error(e, "writing") from e
            return
        self._upload(1, first)
        if self._buf:
            self._upload(self._number, self._buf)
            self._buf = bytearray()
        parts = sorted(self._results(), key=lambda p: p["PartNumber"])
        try:
            self.client.complete_multipart_upload(Bucket=self.bucket, Key=self.key, UploadId=self._upload_id,
                                                  MultipartUpload={"Parts": parts})
        except Exception as e:
            raise self._error(e, "completing the upload") from e
        self._close_threads()

    def abort(self) -> None:
        self._close_threads()
        self._buf, self._first = bytearray(), None
        upload_id, self._upload_id = self._upload_id, None
        if upload_id is not None:
            try:
                self.client.abort_multipart_upload(Bucket=self.bucket, Key=self.key, UploadId=upload_id)
            except Exception:
                pass  # an upload left incomplete is aborted by the next save (S3Storage.remove)
