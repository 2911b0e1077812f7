"""What Azure Blob's failures mean for a checkpoint: each azure-core error as a CheckpointError.

azure-core retries transient failures itself (timeouts, 408/429/5xx: ``retries`` attempts with
backoff); what reaches here has used them up or is not transient. A missing container or blob is a
``CheckpointNotFoundError`` (or the ``missing`` class a caller names), refused credentials a
``StorageAccessError``, an unreachable or failing service a ``StorageUnavailableError``, each naming
the URL and what to do.
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

__all__ = ["FAILURES", "error_code", "status", "is_missing", "is_conflict", "storage_error", "write_error"]

_ACCESS = {"AuthenticationFailed", "AuthorizationFailure", "AuthorizationPermissionMismatch",
           "InsufficientAccountPermissions", "AccountIsDisabled", "InvalidAuthenticationInfo"}


def error_code(e: BaseException) -> str | None:
    """Azure's error code of ``e`` (``"BlobNotFound"``, ``"ConditionNotMet"``, ...), else None."""
    code = getattr(e, "error_code", None)
    return str(getattr(code, "value", code)) if code is not None else None  # a StorageErrorCode is an enum


def status(e: BaseException) -> int | None:
    code = getattr(e, "status_code", None)
    return code if isinstance(code, int) else None


def is_missing(e: BaseException) -> bool:
    """A missing blob (not a missing container)."""
    return error_code(e) == "BlobNotFound" or (status(e) == 404 and error_code(e) != "ContainerNotFound")


def is_conflict(e: BaseException) -> bool:
    """A condition refused: 412 (If-Match, If-None-Match, a lease the request lacks) or 409 (the blob
    exists, a lease is held by another)."""
    return status(e) in (409, 412)


def storage_error(e: BaseException, url: str, *, what: str, entry: str | None = None,
                  missing: type[CheckpointError] = CheckpointNotFoundError) -> CheckpointError:
    """The CheckpointError for azure-core's ``e`` raised while doing ``what`` on ``url``."""
    if isinstance(e, CheckpointError):
        return e
    from azure.core import exceptions as az
    code, st = error_code(e), status(e)
    if code == "ContainerNotFound":
        return missing(f"{what}: no such container (create it first, or check the URL)", path=url, entry=entry)
    if is_missing(e):
        return missing(f"{what}: no such blob", path=url, entry=entry)
    if isinstance(e, az.ClientAuthenticationError) or code in _ACCESS or st == 403:
        return StorageAccessError(f"{what}: Azure refused the credentials or the request ({code or st}); check "
                                  "AZURE_STORAGE_CONNECTION_STRING or the account key / SAS token (or "
                                  "storage_options) and the container's permissions", path=url, entry=entry)
    if isinstance(e, (az.ServiceRequestError, az.ServiceResponseError, *TRANSIENT_STREAM_ERRORS)):
        return StorageUnavailableError(f"{what}: the blob service is unreachable or stopped answering "
                                       f"({type(e).__name__}); check the account URL / connection string's "
                                       "BlobEndpoint and the network", path=url, entry=entry)
    return failing_or_other(e, st, code, service="the blob service", what=what, url=url, entry=entry)


def write_error(e: BaseException, url: str, *, what: str) -> CheckpointError:
    """:func:`storage_error` for a write (``storage/failures.py`` ``as_write_error``)."""
    return as_write_error(storage_error(e, url, what=what, missing=CheckpointWriteError), url)


#: the rules of this store for the shared core
FAILURES = StoreFailures(storage_error, write_error, is_conflict, is_missing)
