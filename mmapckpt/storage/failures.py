"""What an object store's failures mean for a checkpoint, the shapes every store shares (``s3/failures.py``,
``azure/failures.py``, ``gcs/failures.py`` say how their client's errors read).

Each store's ``storage_error`` turns its client's error into a CheckpointError naming the URL: a missing
bucket or object a ``CheckpointNotFoundError`` (or the ``missing`` class a caller names), refused
credentials a ``StorageAccessError``, an unreachable or failing store a ``StorageUnavailableError``.
:func:`failing_or_other` is the common end of those rules, :func:`as_write_error` the rule for writes, and
:class:`StoreFailures` bundles one store's rules for the shared core (``object_store.py``, ``leased_lock.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..errors import CheckpointError, CheckpointWriteError, StorageAccessError, StorageUnavailableError

__all__ = ["StoreFailures", "as_write_error", "failing_or_other"]


def failing_or_other(e: BaseException, status: int | None, code: str | None, *, service: str, what: str, url: str,
                     entry: str | None) -> CheckpointError:
    """The end of every store's rules: an answer of 5xx, 408 or 429 that outlived the retries is the store failing
    (``StorageUnavailableError``); anything else is a CheckpointError naming the client's error."""
    if status is not None and (status >= 500 or status in (408, 429)):
        return StorageUnavailableError(f"{what}: {service} kept failing past the retries allowed ({code or status}); "
                                       "try again later", path=url, entry=entry)
    return CheckpointError(f"{what}: {type(e).__name__}: {e}"[:600], path=url, entry=entry)


def as_write_error(err: CheckpointError, url: str) -> CheckpointError:
    """A store's error ``err`` met while writing: refused credentials and an unreachable store keep their classes,
    everything else (a missing bucket included) is a CheckpointWriteError."""
    if isinstance(err, (StorageAccessError, StorageUnavailableError, CheckpointWriteError)):
        return err
    return CheckpointWriteError(err.message, path=url)


@dataclass(frozen=True)
class StoreFailures:
    """One store's rules: its ``storage_error`` and ``write_error`` (``(e, url, what=...)``), which of its errors is
    a conditional request refused, and which a missing object."""

    storage_error: Callable[..., CheckpointError]
    write_error: Callable[..., CheckpointError]
    refused: Callable[[BaseException], bool]
    missing: Callable[[BaseException], bool]
