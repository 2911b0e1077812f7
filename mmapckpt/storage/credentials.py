"""One redaction rule for credentials, wherever a caller's ``storage_options`` are shown.

Every object that holds ``storage_options`` (``S3Options``, ``MmapReader``/``MmapWriter``'s
:class:`StorageOptions`) shows them through :func:`redacted`, so no repr, str, message or log line
built from them carries a credential:

- a secret (``secret``, ``token``, ``aws_secret_access_key``, ``aws_session_token``, and any option
  whose name says password, secret, token, credential, signature, or is a key other than the
  access key id: ``api_key``, ``account_key``, ..., and an Azure ``connection_string``): ``'***'``, nothing of it, not even its length;
- the access key id (``key``, ``aws_access_key_id``): asterisks and its last four characters
  (``'****MPLE'``), as ``aws configure list`` shows it; only asterisks where the id is shorter than
  16 characters (AWS key ids have 20). AWS does not count the id as a secret, but it is half of the
  pair, names the account it belongs to (``sts get-access-key-info``), and secret scanners flag it in
  logs; its last four characters are enough to tell which of one's keys a job used;
- a password inside a URL (``http://user:PASS@host``): ``***``.

Mappings inside options (``client_kwargs``) follow the same rule.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any

__all__ = ["StorageOptions", "redacted", "redact_value"]

MASK = "***"
_KEY_IDS = frozenset({"key", "aws_access_key_id", "access_key_id", "access_key"})
_SECRET_WORDS = re.compile(r"secret|token|passw|credential|signature|key|sas|auth", re.IGNORECASE)
#: options that carry a secret although their names say none (an Azure connection string holds the account key)
_SECRET_NAMES = frozenset({"connection_string", "conn_str"})
_URL_PASSWORD = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.-]*://[^/@:\s]*):[^/@\s]*@")
#: key ids shorter than this are shown as asterisks only (four characters of a short id would be much of it)
_SHOWN_FROM = 16


def redact_value(name: str, value: Any) -> Any:
    """``value`` of option ``name`` as it may be shown (None stays None: "not given" is worth telling)."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, Mapping):
        return redacted(value)
    lowered = name.lower()
    if lowered in _KEY_IDS:
        text = str(value)
        return "****" + text[-4:] if len(text) >= _SHOWN_FROM else "****"
    if _SECRET_WORDS.search(lowered) or lowered in _SECRET_NAMES:
        return MASK
    if isinstance(value, str):
        return _URL_PASSWORD.sub(lambda m: f"{m['head']}:{MASK}@", value)
    return value


def redacted(options: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``options`` fit to show (see the module docstring)."""
    return {k: redact_value(str(k), v) for k, v in options.items()}


class StorageOptions(Mapping[str, Any]):
    """A caller's ``storage_options``, read-only, whose repr and str are :func:`redacted`.

    It is what readers and writers keep, so that printing one (or its ``vars()``) shows no credential;
    the values themselves are there for the storage that needs them.
    """

    __slots__ = ("_items",)

    def __init__(self, options: Mapping[str, Any] | None = None) -> None:
        self._items = dict(options or {})

    def __getitem__(self, name: str) -> Any:
        return self._items[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return repr(redacted(self._items))

    def __reduce__(self) -> tuple[Any, ...]:  # pickled as a plain mapping (DCP's process-based async saves)
        return (StorageOptions, (self._items,))
