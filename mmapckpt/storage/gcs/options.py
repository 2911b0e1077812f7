"""How a ``gs://`` location is reached: its bucket and prefix, the project, the credentials, the client.

Settings come from Google's standard environment, as google-cloud-storage and gcsfs read it:
``GOOGLE_APPLICATION_CREDENTIALS`` (a service account's key file) or the other Application Default
Credentials (``gcloud auth application-default login``, the metadata server of a GCE/GKE machine),
``GOOGLE_CLOUD_PROJECT``, and ``STORAGE_EMULATOR_HOST`` (an emulator's URL: unsigned requests there).
A caller's ``storage_options`` override them (gcsfs's names): ``project``, ``token`` (the path of a
service account key file, or ``"anon"``), ``anon``, ``endpoint_url``.

Transfers: ``part_size`` (bytes of one ranged GET, 16 MiB), ``concurrency`` (GETs in flight, 16),
``upload_part_size`` (bytes of one uploaded part, 16 MiB), ``upload_concurrency`` (parts in flight per
shard, 4), ``retries`` (5), ``timeout`` (seconds per request, 60), the save lock's ``lock_lease`` (30 s),
``lock_wait`` (60 s), ``lock_job`` (storage/holders.py), and ``require_preconditions`` (True: a store
that ignores generation preconditions is refused at the lock; False: its lock is advisory, with a
warning; for emulators that lack them). An unknown key is refused; the repr shows no credential.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from ...errors import CheckpointError
from ..store_options import Clients, StoreOptions, bucket_and_prefix

__all__ = ["GCSOptions", "parse_url", "client_for", "gcs"]

#: GCS's bounds on composing: 32 sources a compose, 1024 components in an object
MAX_SOURCES = 32
MAX_COMPONENTS = 1024


@dataclasses.dataclass(frozen=True, repr=False)
class GCSOptions(StoreOptions):
    """The settings of one client and its transfers (see the module docstring); its repr shows no credential."""

    project: str | None = None
    token: str | None = None
    anon: bool = False
    endpoint_url: str | None = None
    timeout: float = 60.0
    require_preconditions: bool = True

    scheme = "gs"

    @classmethod
    def of(cls, options: Mapping[str, Any] | None) -> GCSOptions:
        given = dict(options or {})
        cls.refuse_unknown(given)
        if given.get("token") == "anon":
            given["token"], given["anon"] = None, True
        out = cls(**given)
        out.check_bounds()
        if out.anon and out.token:
            raise CheckpointError("storage_options: anon=True sends unsigned requests, so the token given would be "
                                  "ignored; give either anon=True or token")
        return out


def parse_url(url: str) -> tuple[str, str]:
    """``(bucket, prefix)`` of ``gs://BUCKET/PREFIX`` (the prefix without slashes at either end; may be empty)."""
    return bucket_and_prefix(url)


def gcs() -> Any:
    """``google.cloud.storage``, imported on first use (``import mmapckpt`` never imports it).

    Raises:
        CheckpointError: the ``gcs`` extra is not installed.
    """
    try:
        import google.api_core.exceptions  # noqa: F401
        from google.cloud import storage
    except ImportError:
        raise CheckpointError("gs:// checkpoints need the gcs extra (google-cloud-storage): "
                              "pip install 'mmapckpt[gcs]'") from None
    return storage


_clients = Clients()


def client_for(opts: GCSOptions, url: str) -> Any:
    """A ``google.cloud.storage.Client`` for ``opts`` and the environment (made once, shared: thread-safe)."""
    env = tuple(os.environ.get(n) for n in ("GOOGLE_APPLICATION_CREDENTIALS", "GOOGLE_CLOUD_PROJECT",
                                            "STORAGE_EMULATOR_HOST"))
    return _clients.get((opts, env), lambda: _make_client(opts, url))


def _make_client(opts: GCSOptions, url: str) -> Any:
    storage = gcs()
    import requests
    from google.auth.credentials import AnonymousCredentials
    endpoint = opts.endpoint_url or os.environ.get("STORAGE_EMULATOR_HOST")
    if endpoint and "://" not in endpoint:
        endpoint = f"http://{endpoint}"
    project = opts.project or os.environ.get("GOOGLE_CLOUD_PROJECT")
    kwargs: dict[str, Any] = {}
    if endpoint:
        kwargs["client_options"] = {"api_endpoint": endpoint}
    if opts.anon or (endpoint and not opts.token and not os.environ.get("GOOGLE_APPLICATION_CREDENTIALS")):
        kwargs["credentials"] = AnonymousCredentials()
        project = project or "anonymous"
    elif opts.token:
        from google.oauth2 import service_account
        try:
            kwargs["credentials"] = service_account.Credentials.from_service_account_file(
                opts.token, scopes=["https://www.googleapis.com/auth/devstorage.read_write"])
        except (OSError, ValueError) as e:
            from ...errors import StorageAccessError
            raise StorageAccessError(f"storage_options token: not a readable service account key file "
                                     f"({type(e).__name__})", path=url) from None
    try:
        client = storage.Client(project=project, **kwargs)
    except Exception as e:
        from .failures import storage_error
        raise storage_error(e, url, what="making the GCS client") from e
    # a pool for every request in flight (requests keeps 10 by default)
    size = max(opts.concurrency, opts.upload_concurrency) * 2 + 4
    adapter = requests.adapters.HTTPAdapter(pool_connections=size, pool_maxsize=size)
    client._http.mount("http://", adapter)
    client._http.mount("https://", adapter)
    return client
