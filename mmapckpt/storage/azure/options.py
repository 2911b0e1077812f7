"""How an ``az://`` location is reached: its container and prefix, the account, the credentials, the client.

Settings come from the environment the Azure CLI and adlfs read, and a caller's ``storage_options``
override them (adlfs's names):

- ``connection_string`` (``AZURE_STORAGE_CONNECTION_STRING``): the account, its key or SAS and its
  endpoint in one string (Azurite's is ``UseDevelopmentStorage=true`` or an explicit one);
- ``account_name`` (``AZURE_STORAGE_ACCOUNT_NAME``, or the CLI's ``AZURE_STORAGE_ACCOUNT``) with
  ``account_key`` (``AZURE_STORAGE_ACCOUNT_KEY`` / ``AZURE_STORAGE_KEY``) or ``sas_token``
  (``AZURE_STORAGE_SAS_TOKEN``), or ``anon=True`` for a public container;
- ``account_url`` (``AZURE_STORAGE_BLOB_ENDPOINT``): the blob endpoint, by default
  ``https://ACCOUNT.blob.core.windows.net`` (an emulator's ``http://127.0.0.1:10000/devstoreaccount1``).

Transfers: ``part_size`` (bytes of one ranged GET, 16 MiB), ``concurrency`` (GETs in flight, 16),
``upload_part_size`` (bytes of one staged block, 16 MiB), ``upload_concurrency`` (blocks in flight per
shard, 4), ``retries`` (5), ``connect_timeout``/``read_timeout`` (5, 60 s), and the save lock's
``lock_lease`` (seconds; Azure leases last 15 to 60 s, so it is clamped there; default 30),
``lock_wait`` (60 s) and ``lock_job`` (storage/holders.py). An unknown key is refused; the repr shows
no credential (storage/credentials.py).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from ...errors import CheckpointError
from ..store_options import Clients, MiB, StoreOptions

__all__ = ["AzureOptions", "parse_url", "client_for", "azure_blob", "SCHEMES"]

#: Azure's bounds on a block blob: at most 50,000 blocks of at most 4000 MiB
MAX_BLOCKS = 50_000
#: The URL schemes served: ``az://`` (adlfs's and obstore's spelling), and ``abfs://`` as adlfs takes it
SCHEMES = ("az", "abfs")
#: The emulator's well-known development account (Azurite; documented by Microsoft, not a secret)
DEV_ACCOUNT = "devstoreaccount1"

_ENV = {  # option -> the environment variables read for it, first found wins
    "connection_string": ("AZURE_STORAGE_CONNECTION_STRING",),
    "account_name": ("AZURE_STORAGE_ACCOUNT_NAME", "AZURE_STORAGE_ACCOUNT"),
    "account_key": ("AZURE_STORAGE_ACCOUNT_KEY", "AZURE_STORAGE_KEY"),
    "sas_token": ("AZURE_STORAGE_SAS_TOKEN",),
    "account_url": ("AZURE_STORAGE_BLOB_ENDPOINT",),
}


@dataclasses.dataclass(frozen=True, repr=False)
class AzureOptions(StoreOptions):
    """The settings of one client and its transfers (see the module docstring); its repr shows no credential."""

    connection_string: str | None = None
    account_name: str | None = None
    account_key: str | None = None
    sas_token: str | None = None
    account_url: str | None = None
    anon: bool = False
    connect_timeout: float = 5.0
    read_timeout: float = 60.0

    scheme = "az"

    @classmethod
    def of(cls, options: Mapping[str, Any] | None, account: str | None = None) -> AzureOptions:
        """The options of ``storage_options``, the environment filling in what they leave out (credentials
        are taken from one place: the options where they give any, else the environment)."""
        given = dict(options or {})
        cls.refuse_unknown(given)
        credentials = ("connection_string", "account_key", "sas_token", "anon")
        if not any(given.get(k) for k in credentials):
            for k in credentials[:-1]:
                given.setdefault(k, _env(k))
        for k in ("account_name", "account_url"):
            if given.get(k) is None:
                given[k] = _env(k)
        if account and given.get("account_name") is None:
            given["account_name"] = account
        out = cls(**given)
        out.check_bounds()
        if out.anon and (out.account_key or out.sas_token or out.connection_string):
            raise CheckpointError("storage_options: anon=True sends unsigned requests, so the key, SAS token or "
                                  "connection string given would be ignored; give either anon=True or credentials")
        if out.account_key and out.sas_token:
            raise CheckpointError("storage_options: give account_key or sas_token, not both")
        return out

    @property
    def lease_seconds(self) -> int:
        """The lock's lease as Azure takes it: whole seconds from 15 to 60."""
        return int(min(60, max(15, round(self.lock_lease))))


def _env(option: str) -> str | None:
    for name in _ENV[option]:
        value = os.environ.get(name)
        if value:
            return value
    return None


def parse_url(url: str) -> tuple[str, str, str | None]:
    """``(container, prefix, account or None)`` of ``az://CONTAINER/PREFIX`` or
    ``abfs://CONTAINER@ACCOUNT.dfs.core.windows.net/PREFIX`` (the prefix without slashes at either end)."""
    rest = url.split("://", 1)[1]
    container, _, prefix = rest.partition("/")
    account = None
    if "@" in container:
        container, _, host = container.partition("@")
        account = host.split(".", 1)[0] or None
    if not container:
        raise CheckpointError("an az:// URL needs a container: az://CONTAINER/PREFIX", path=url)
    return container, prefix.strip("/"), account


def azure_blob() -> Any:
    """The ``azure.storage.blob`` module, imported on first use (``import mmapckpt`` never imports it).

    Raises:
        CheckpointError: the ``azure`` extra is not installed.
    """
    try:
        import azure.core.exceptions  # noqa: F401
        import azure.storage.blob as blob
    except ImportError:
        raise CheckpointError("az:// checkpoints need the azure extra (azure-storage-blob): "
                              "pip install 'mmapckpt[azure]'") from None
    return blob


_clients = Clients()


def client_for(opts: AzureOptions, container: str, url: str) -> Any:
    """A ``ContainerClient`` for ``opts`` (made once per settings and shared: its pipeline is thread-safe)."""
    return _clients.get((opts, container), lambda: _make_client(opts, container, url))


def _make_client(opts: AzureOptions, container: str, url: str) -> Any:
    blob = azure_blob()
    common: dict[str, Any] = {"retry_total": opts.retries, "connection_timeout": opts.connect_timeout,
                              "read_timeout": opts.read_timeout,
                              # shards carry their own CRC-32s: one request per part, no client-side chunking
                              "max_single_get_size": opts.part_size, "max_chunk_get_size": opts.part_size,
                              "max_single_put_size": 64 * MiB, "max_block_size": opts.upload_part_size,
                              "transport": _transport(opts)}
    if opts.connection_string:
        return blob.ContainerClient.from_connection_string(opts.connection_string, container, **common)
    account_url = opts.account_url
    if account_url is None:
        if not opts.account_name:
            from ...errors import StorageAccessError
            raise StorageAccessError("no Azure account: set AZURE_STORAGE_CONNECTION_STRING, or "
                                     "AZURE_STORAGE_ACCOUNT_NAME with AZURE_STORAGE_ACCOUNT_KEY or "
                                     "AZURE_STORAGE_SAS_TOKEN (or storage_options connection_string / "
                                     "account_name, account_key, sas_token)", path=url)
        account_url = f"https://{opts.account_name}.blob.core.windows.net"
    credential: Any = None
    if opts.account_key:
        credential = {"account_name": opts.account_name or _account_of(account_url), "account_key": opts.account_key}
    elif opts.sas_token:
        credential = opts.sas_token.lstrip("?")
    elif not opts.anon:
        credential = _default_credential(url)
    return blob.ContainerClient(account_url, container, credential=credential, **common)


def _transport(opts: AzureOptions) -> Any:
    """azure-core's requests transport with a connection pool for every request in flight (its default keeps 10)."""
    import requests
    from azure.core.pipeline.transport import RequestsTransport
    session = requests.Session()
    size = max(opts.concurrency, opts.upload_concurrency) * 2 + 4
    adapter = requests.adapters.HTTPAdapter(pool_connections=size, pool_maxsize=size)
    session.mount("http://", adapter)
    session.mount("https://", adapter)
    return RequestsTransport(session=session, session_owner=True)


def _account_of(account_url: str) -> str:
    """The account of a blob endpoint: its first host label, or its path for an emulator (``/devstoreaccount1``)."""
    rest = account_url.split("://", 1)[-1]
    host, _, path = rest.partition("/")
    if path.strip("/"):
        return path.strip("/").split("/")[0]
    return host.split(".", 1)[0]


def _default_credential(url: str) -> Any:
    """Entra ID (managed identity, ``az login``, workload identity) where azure-identity is installed."""
    try:
        from azure.identity import DefaultAzureCredential
    except ImportError:
        from ...errors import StorageAccessError
        raise StorageAccessError("no Azure credentials: set AZURE_STORAGE_CONNECTION_STRING, or "
                                 "AZURE_STORAGE_ACCOUNT_KEY or AZURE_STORAGE_SAS_TOKEN with the account (or "
                                 "storage_options), pass anon=True for a public container, or install "
                                 "azure-identity for Entra ID sign-in", path=url) from None
    return DefaultAzureCredential()
