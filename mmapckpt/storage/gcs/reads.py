"""Ranged GETs of one object generation straight into the callers' buffers (``storage/ranged.py``).

Each request names the generation the object had when opened: GCS serves that generation or nothing (an object
replaced since has another generation, and the old one is gone without versioning: 404), so a load never mixes two
versions. The GET is the media download google-cloud-storage itself makes (its URL, the client's authorized
session, ``retry`` for a request that fails), with the body left unread: ``storage/ranged.py`` reads it into the
buffers themselves, the bytes as stored (no decoding: as ``raw_download``). ``download_to_file`` would hand the
body over in 8 KiB chunks to a writer that copies each.
"""

from __future__ import annotations

from typing import Any, Callable

from ..ranged import RangedReads, replaced_while_read
from .failures import FAILURES, is_missing, is_precondition_failed, storage_error

__all__ = ["ObjectReads"]


class ObjectReads(RangedReads):
    """Ranged reads of generation ``generation`` of object ``key`` (``size`` bytes)."""

    pool_name = "gs"
    failures = FAILURES

    def __init__(self, bucket: Any, key: str, generation: int | None, size: int, url: str, part_size: int,
                 concurrency: int, on_fetch: Callable[[int, int], None] | None = None, *, retry: Any = None,
                 timeout: float = 60.0, retries: int = 5) -> None:
        super().__init__(size, url, part_size, concurrency, on_fetch, retries=retries)
        self.bucket, self.key, self.generation = bucket, key, generation
        self.retry, self.timeout = retry, timeout
        self._download_url: str | None = None

    def _open(self, start: int, length: int, entry: str | None) -> Any:
        from google.cloud.exceptions import from_http_response

        client = self.bucket.client
        if self._download_url is None:
            self._download_url = self.bucket.blob(self.key, generation=self.generation)._get_download_url(client)
        url, headers = self._download_url, {"Range": f"bytes={start}-{start + length - 1}"}

        def get() -> Any:
            response = client._http.request("GET", url, headers=headers, stream=True, timeout=self.timeout)
            if response.status_code not in (200, 206):
                try:
                    error = from_http_response(response)  # NotFound, PreconditionFailed, ServiceUnavailable...
                finally:
                    response.close()
                raise error
            return response

        try:
            response = self.retry(get)() if self.retry is not None else get()
        except Exception as e:
            if is_missing(e) or is_precondition_failed(e):
                raise replaced_while_read("object", self.url, entry, "replaced or removed") from None
            raise storage_error(e, self.url, what="reading", entry=entry) from e
        return response.raw  # urllib3's response (requests made it with decode_content off)
