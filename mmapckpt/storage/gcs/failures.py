"""What GCS's failures mean for a checkpoint: each google-api-core / google-auth error as a CheckpointError.

google-cloud-storage retries transient failures itself (its default retry: 429, 5xx, connection
errors, for idempotent calls and those made conditional); what reaches here has used that up or is
not transient. A missing bucket or object is a ``CheckpointNotFoundError`` (or the ``missing`` class a
caller names), refused or absent credentials a ``StorageAccessError``, an unreachable or failing
service a ``StorageUnavailableError``, each naming the URL and what to do.
"""

from __future__ import annotations

from ..failures import StoreFailures, as_write_error, failing_or_other
from ..ranged import TRANSIENT_STREAM_ERRORS
from ...errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointWriteError,
    StorageAccessError,
    StorageUnavailableError,
)

__all__ = ["FAILURES", "status", "is_missing", "is_precondition_failed", "storage_error", "write_error"]


def status(e: BaseException) -> int | None:
    code = getattr(e, "code", None)
    if isinstance(code, int):
        return code
    response = getattr(e, "response", None)
    code = getattr(response, "status_code", None)
    return code if isinstance(code, int) else None



def is_missing(e: BaseException) -> bool:
    """A missing object (404)."""
    return status(e) == 404


def is_precondition_failed(e: BaseException) -> bool:
    """A generation precondition refused: 412 (or 304 for a conditional read)."""
    return status(e) in (412, 304)


def storage_error(e: BaseException, url: str, *, what: str, entry: str | None = None,
                  missing: type[CheckpointError] = CheckpointNotFoundError) -> CheckpointError:
    """The CheckpointError for ``e`` raised while doing ``what`` on ``url``."""
    if isinstance(e, CheckpointError):
        return e
    import google.api_core.exceptions as api
    import google.auth.exceptions as auth
    import requests
    if isinstance(e, api.RetryError) and e.cause is not None:  # the retries ran out: judge by the last failure
        e = e.cause
    st = status(e)
    if isinstance(e, auth.DefaultCredentialsError):
        return StorageAccessError(f"{what}: no Google credentials (set GOOGLE_APPLICATION_CREDENTIALS to a service "
                                  "account key file, run `gcloud auth application-default login`, give "
                                  "storage_options token, or anon=True for a public bucket)", path=url, entry=entry)
    if st == 404:
        return missing(f"{what}: no such bucket or object (create the bucket first, or check the URL)", path=url,
                       entry=entry)
    if st in (401, 403) or isinstance(e, auth.RefreshError):
        return StorageAccessError(f"{what}: GCS refused the credentials or the request ({st}); check "
                                  "GOOGLE_APPLICATION_CREDENTIALS (or storage_options token) and the bucket's "
                                  "permissions", path=url, entry=entry)
    if isinstance(e, (requests.exceptions.ConnectionError, requests.exceptions.Timeout, auth.TransportError,
                      *TRANSIENT_STREAM_ERRORS)):
        return StorageUnavailableError(f"{what}: GCS is unreachable or stopped answering ({type(e).__name__}); "
                                       "check STORAGE_EMULATOR_HOST / storage_options endpoint_url and the network",
                                       path=url, entry=entry)
    return failing_or_other(e, st, None, service="GCS", what=what, url=url, entry=entry)


def write_error(e: BaseException, url: str, *, what: str) -> CheckpointError:
    """:func:`storage_error` for a write (``storage/failures.py`` ``as_write_error``)."""
    return as_write_error(storage_error(e, url, what=what, missing=CheckpointWriteError), url)


#: the rules of this store for the shared core
FAILURES = StoreFailures(storage_error, write_error, is_precondition_failed, is_missing)
