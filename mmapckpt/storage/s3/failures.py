"""What an object store's failures mean for a checkpoint: each botocore error as a CheckpointError.

botocore retries transient failures itself (timeouts, 5xx, throttling: the ``standard`` mode
with the bound of ``S3Options.retries``); what reaches here has used up its retries or is not
transient. A missing bucket or object is a ``CheckpointNotFoundError`` (or the ``missing`` class a
caller names), refused credentials a ``StorageAccessError``, an unreachable or failing store a
``StorageUnavailableError``, each naming the URL.
"""

from __future__ import annotations

from typing import Any

from ..failures import StoreFailures, as_write_error, failing_or_other
from ..ranged import TRANSIENT_STREAM_ERRORS
from ...errors import (
    CheckpointError,
    CheckpointWriteError,
    CheckpointNotFoundError,
    StorageAccessError,
    StorageUnavailableError,
)

__all__ = ["FAILURES", "error_code", "is_missing", "is_precondition_failed", "storage_error", "write_error",
           "TRANSIENT_STREAM_ERRORS"]

_ACCESS = {"InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "ExpiredToken", "InvalidToken",
           "TokenRefreshRequired", "AllAccessDisabled", "AuthorizationHeaderMalformed", "403"}
_MISSING_KEY = {"NoSuchKey", "404", "NotFound"}


def error_code(e: BaseException) -> str | None:
    """The S3 error code of a botocore ClientError (``"NoSuchKey"``, ``"404"`` for a HEAD), else None."""
    response = getattr(e, "response", None)
    if not isinstance(response, dict):
        return None
    code = response.get("Error", {}).get("Code")
    return str(code) if code is not None else None


def is_missing(e: BaseException) -> bool:
    """A missing object (not a missing bucket)."""
    return error_code(e) in _MISSING_KEY


def is_precondition_failed(e: BaseException) -> bool:
    """A conditional request refused (``If-Match``/``If-None-Match``): 412 PreconditionFailed."""
    return error_code(e) in ("PreconditionFailed", "412")


def storage_error(e: BaseException, url: str, *, what: str, entry: str | None = None,
                  missing: type[CheckpointError] = CheckpointNotFoundError) -> CheckpointError:
    """The CheckpointError for botocore's ``e`` raised while doing ``what`` on ``url``."""
    _, botocore = _botocore()
    exc = botocore.exceptions
    code = error_code(e)
    if isinstance(e, (exc.NoCredentialsError, exc.PartialCredentialsError)):
        return StorageAccessError(f"{what}: no credentials for the object store (set AWS_ACCESS_KEY_ID and "
                                  "AWS_SECRET_ACCESS_KEY, a profile, storage_options key/secret, or anon=True "
                                  "for a public bucket)", path=url, entry=entry)
    if code == "NoSuchBucket":
        return missing(f"{what}: no such bucket (create it first, or check the URL)", path=url, entry=entry)
    if code in _MISSING_KEY:
        return missing(f"{what}: no such object", path=url, entry=entry)
    if code in _ACCESS:
        return StorageAccessError(f"{what}: the object store refused the credentials or the request ({code}); "
                                  "check AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY (or storage_options) and the "
                                  "bucket's permissions", path=url, entry=entry)
    if isinstance(e, (exc.EndpointConnectionError, exc.ConnectTimeoutError, exc.ReadTimeoutError,
                      exc.ConnectionClosedError, exc.ProxyConnectionError)) or isinstance(e, TRANSIENT_STREAM_ERRORS):
        return StorageUnavailableError(f"{what}: the object store is unreachable or stopped answering ({e}); "
                                       "check AWS_ENDPOINT_URL / storage_options endpoint_url and the network",
                                       path=url, entry=entry)
    status = (getattr(e, "response", None) or {}).get("ResponseMetadata", {}).get("HTTPStatusCode")
    if code in ("SlowDown", "Throttling", "ServiceUnavailable", "InternalError", "RequestTimeout"):
        status = 503
    return failing_or_other(e, status if isinstance(status, int) else None, code, service="the object store",
                            what=what, url=url, entry=entry)


def write_error(e: BaseException, url: str, *, what: str) -> CheckpointError:
    """:func:`storage_error` for a write (``storage/failures.py`` ``as_write_error``)."""
    return as_write_error(storage_error(e, url, what=what, missing=CheckpointWriteError), url)


def _botocore() -> tuple[Any, Any]:
    from .options import boto
    return boto()





#: the rules of this store for the shared core
FAILURES = StoreFailures(storage_error, write_error, is_precondition_failed, is_missing)
