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
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any

from ...errors import CheckpointError
from ..base import FileOutput
from .failures import write_error
from .options import MAX_COMPONENTS, MAX_SOURCES

__all__ = ["ComposedOutput", "part_size_for"]


def part_size_for(size: int | None, wanted: int) -> int:
    """``wanted``, raised (in MiB steps) so that an object of ``size`` bytes needs at most 1024 components."""
    parts = MAX_COMPONENTS - 1  # one is the head's
    if size is None or size <= wanted * parts:
        return wanted
    mib = 1 << 20
    return -(-size // parts // mib) * mib + mib


class ComposedOutput(FileOutput):
    """Object ``key`` being written (see the module docstring)."""

    how = "composed"

    def __init__(self, bucket: Any, key: str, url: str, size: int | None, *, head: int, part_size: int,
                 concurrency: int, retry: Any) -> None:
        self.bucket, self.key, self.path, self.size, self.head = bucket, key, url, size, head
        self.part_size = part_size_for(size, part_size)
        self.concurrency, self.retry = concurrency, retry
        directory, _, name = key.rpartition("/")
        self._stem = f"{directory}/" if directory else ""
        self._stem += f".{name}.tmp-{uuid.uuid4().hex[:12]}p"
        self._buf = bytearray()
        self._end = head
        self._parts: list[str] = []  # the temporary objects after the head's, in order
        self._sent: list[Future[None]] = []
        self._threads: ThreadPoolExecutor | None = None

    def put(self, offset: int, data: Any) -> None:
        mv = memoryview(data).cast("B")
        if offset < self._end:
            raise ValueError(f"piece at {offset} before the end of the previous one (or the head) ({self._end})")
        if offset > self._end:
            self._append(memoryview(bytes(offset - self._end)))
        self._append(mv)
        self._end = offset + len(mv)

    def _append(self, mv: memoryview) -> None:
        while len(mv):
            room = self.part_size - len(self._buf)
            self._buf += mv[:room]
            mv = mv[room:]
            if len(self._buf) == self.part_size:
                self._send(self._buf)
                self._buf = bytearray()

    def _send(self, data: bytes | bytearray, name: str | None = None) -> None:
        if name is None:
            name = f"{self._stem}{len(self._parts) + 1:05d}"
            self._parts.append(name)
        if self._threads is None:
            self._threads = ThreadPoolExecutor(self.concurrency, thread_name_prefix="mmapckpt-gs-put")
        while sum(not f.done() for f in self._sent) >= self.concurrency:
            for f in wait([f for f in self._sent if not f.done()], return_when=FIRST_COMPLETED).done:
                f.result()
        self._sent.append(self._threads.submit(self._upload, name, data))

    def _upload(self, name: str, data: bytes | bytearray) -> None:
        try:
            self.bucket.blob(name).upload_from_string(bytes(data), retry=self.retry, checksum=None)
        except Exception as e:
            raise self._error(e, "uploading a part") from e

    def finish(self, head: bytes) -> None:
        if len(head) > self.head:
            raise ValueError(f"head of {len(head)} bytes is longer than the {self.head} bytes kept for it")
        head = bytes(head) + bytes(self.head - len(head))
        if self.size is not None and self._end < self.size:
            self._append(memoryview(bytes(self.size - self._end)))
            self._end = self.size
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
            for f in self._sent:
                f.result()
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

    def _close_threads(self) -> None:
        threads, self._threads = self._threads, None
        if threads is not None:
            threads.shutdown(wait=True, cancel_futures=True)

    def _error(self, e: BaseException, what: str) -> CheckpointError:
        if isinstance(e, CheckpointError):
            return e
        return write_error(e, self.path, what=what)
