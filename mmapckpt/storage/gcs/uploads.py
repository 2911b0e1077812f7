"""A shard written to GCS: parts uploaded as they fill, composed into the object once the head is known.

GCS has no multipart upload whose parts can arrive out of order in its JSON API (a resumable
upload is sequential), but it composes objects: the shard writer's pieces are gathered into parts
of ``upload_part_size`` bytes (raised in MiB steps where a shard would need more than GCS's 1024
components), each full part is uploaded at once as a temporary object
(``.NAME.tmp-TAGpNNNNN``, a name ``storage/commits.py`` removes as a killed save's leftover), at most
``upload_concurrency`` in flight; the head (known last) is part 0, uploaded in :meth:`finish`, and the
parts are composed into ``NAME`` (32 sources a compose, in two rounds where there are more), so memory
stays within ``(upload_concurrency + 1) * upload_part_size``. The object appears under its name only
when the last compose answers; the temporary parts are then deleted (a failed or killed save's are
removed by the next save's cleanup). A shard smaller than one part is one upload.
"""

from __future__ import annotations

import uuid
from typing import Any

from ...errors import CheckpointError
from ..parts import PartedOutput
from ..parts import part_size_for as _part_size_for
from .failures import FAILURES
from .options import MAX_COMPONENTS, MAX_SOURCES

__all__ = ["ComposedOutput", "part_size_for"]


def part_size_for(size: int | None, wanted: int) -> int:
    """``wanted``, raised (in MiB steps) so that an object of ``size`` bytes needs at most 1024 components."""
    return _part_size_for(size, wanted, MAX_COMPONENTS)


class ComposedOutput(PartedOutput):
    """Object ``key`` being written (see the module docstring)."""

    how = "composed"
    failures = FAILURES
    thread_name = "mmapckpt-gs-put"

    def __init__(self, bucket: Any, key: str, url: str, size: int | None, *, head: int, part_size: int,
                 concurrency: int, retry: Any) -> None:
        super().__init__(url, size, start=head, part_size=part_size_for(size, part_size), concurrency=concurrency)
        self.bucket, self.key, self.head, self.retry = bucket, key, head, retry
        directory, _, name = key.rpartition("/")
        self._stem = f"{directory}/" if directory else ""
        self._stem += f".{name}.tmp-{uuid.uuid4().hex[:12]}p"
        self._parts: list[str] = []  # the temporary objects after the head's, in order

    def _full(self, buf: bytearray) -> None:
        self._send(buf)

    def _send(self, data: bytes | bytearray, name: str | None = None) -> None:
        if name is None:
            name = f"{self._stem}{len(self._parts) + 1:05d}"
            self._parts.append(name)
        self._submit(self._upload, name, data)

    def _upload(self, name: str, data: bytes | bytearray) -> None:
        try:
            self.bucket.blob(name).upload_from_string(bytes(data), retry=self.retry, checksum=None)
        except Exception as e:
            raise self._error(e, "uploading a part") from e

    def finish(self, head: bytes) -> None:
        head = self._padded_head(head, self.head)
        self._pad_to_size()
        try:
            if not self._parts:  # smaller than one part: one upload
                self.bucket.blob(self.key).upload_from_string(head + bytes(self._buf), retry=self.retry,
                                                              checksum=None)
                return
            if self._buf:
                self._send(self._buf)
                self._buf = bytearray()
            sources = list(self._parts)
            if head:
                sources.insert(0, f"{self._stem}00000")
                self._send(head, sources[0])
            self._results()
            self._compose(sources)
        except CheckpointError:
            raise
        except Exception as e:
            raise self._error(e, "composing the parts") from e
        finally:
            self._close_threads()
        self._delete_parts()

    def _compose(self, sources: list[str]) -> None:
        """Compose ``sources`` into the object: directly where 32 or fewer, else in groups first."""
        if len(sources) > MAX_SOURCES:
            groups = [sources[i:i + MAX_SOURCES] for i in range(0, len(sources), MAX_SOURCES)]
            sources = []
            for i, group in enumerate(groups):
                name = f"{self._stem}g{i:04d}"
                self.bucket.blob(name).compose([self.bucket.blob(s) for s in group], retry=self.retry)
                self._parts.append(name)
                sources.append(name)
        self.bucket.blob(self.key).compose([self.bucket.blob(s) for s in sources], retry=self.retry)

    def abort(self) -> None:
        self._close_threads()
        self._buf = bytearray()
        self._delete_parts()

    def _delete_parts(self) -> None:
        names = [f"{self._stem}00000", *self._parts]
        self._parts = []
        for name in names:
            try:
                self.bucket.blob(name).delete()
            except Exception:
                pass  # left behind, the next save's cleanup removes it (its name is a temporary file's)
