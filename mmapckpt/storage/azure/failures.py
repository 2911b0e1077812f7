"""What Azure Blob's failures mean for a checkpoint: each azure-core error as a CheckpointError.

azure-core retries transient failures itself (timeouts, 408/429/5xx: ``retries`` attempts with
backoff); what reaches here has used them up or is not transient. A missing container or blob is a
``CheckpointNotFoundError`` (or the ``missing`` class a caller names), refused credentials a
``StorageAccessError``, an unreachable or failing service a ``StorageUnavailableError``, each naming
the URL and what to do.
"""

from __future__ import annotations

from ...errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointWriteError,
    StorageAccessError,
    StorageUnavailableError,
)

__all__ = ["error_code", "status", "is_missing", "is_conflict", "storage_error", "write_error"]

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
    if isinstance(e, (az.ServiceRequestError, az.ServiceResponseError, ConnectionError, TimeoutError)):
        return StorageUnavailableError(f"{what}: the blob service is unreachable or stopped answering "
                                       f"({type(e).__name__}); check the account URL / connection string's "
                                       "BlobEndpoint and the network", path=url, entry=entry)
    if st is not None and (st >= 500 or st in (408, 429)):
        return StorageUnavailableError(f"{what}: the blob service kept failing past the retries allowed "
                                       f"({code or st}); try again later", path=url, entry=entry)
    return CheckpointError(f"{what}: {type(e).__name__}: {e}"[:600], path=url, entry=entry)


def write_error(e: BaseException, url: str, *, what: str) -> CheckpointError:
    """:func:`storage_error` for a write: refused credentials and an unreachable service keep their classes,
    everything else (a missing container included) is a CheckpointWriteError."""
    err = storage_error(e, url, what=what, missing=CheckpointWriteError)
    if isinstance(err, (StorageAccessError, StorageUnavailableError, CheckpointWriteError)):
        return err
    return CheckpointWriteError(err.message, path=url)
