"""How an ``s3://`` location is reached: its bucket and prefix, the client's settings, the client.

Settings come, as boto3 and the AWS CLI take them, from the standard environment
(``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``,
``AWS_REGION``/``AWS_DEFAULT_REGION``, ``AWS_PROFILE``, the shared config files), and a caller's
``storage_options`` override them. Keys of ``storage_options`` (s3fs's names where s3fs has one):

- credentials and endpoint: ``key``, ``secret``, ``token`` (``key`` and ``secret`` together;
  ``token`` only with both, since a session token is valid only with the pair it was issued with;
  anything else is refused rather than dropped), ``profile``, ``anon`` (unsigned requests, with no
  credentials given), ``endpoint_url``, ``region_name``, ``addressing_style`` (``"path"`` by default
  where an endpoint is given, as S3-compatible stores want), ``client_kwargs`` (a dict
  whose ``endpoint_url``/``region_name`` are taken as s3fs takes them);
- transfers: ``part_size`` (bytes of one ranged GET, default 16 MiB), ``concurrency`` (GETs in
  flight, default 16), ``upload_part_size`` (default 16 MiB; at least 5 MiB, as S3 requires),
  ``upload_concurrency`` (parts in flight per shard, default 4), ``retries`` (attempts per request
  after the first, default 5), ``connect_timeout`` and ``read_timeout`` (seconds, 5 and 60),
  ``lock_lease`` (seconds a save's lock lives without renewal, default 30; renewed every quarter of it),
  ``lock_wait`` (seconds a save waits for another live save's lock before it raises, default 60),
  ``lock_job`` (this job's identity: a lock held by another process of the same job is an
  earlier run's and is taken over at once; default ``TORCHELASTIC_RUN_ID`` or ``SLURM_JOB_ID``,
  ``""`` for none: storage/holders.py).

An unknown key is refused (a misspelt option would otherwise be ignored silently).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from ...errors import CheckpointError
from ..store_options import Clients, MiB, StoreOptions, bucket_and_prefix
from .quick_acks import quick_acks

__all__ = ["S3Options", "parse_url", "client_for", "boto"]

#: S3's bounds on a multipart upload: parts of at least 5 MiB (but the last), at most 10,000 parts
MIN_PART = 5 * MiB
MAX_PARTS = 10_000

_ALIASES = {"aws_access_key_id": "key", "aws_secret_access_key": "secret", "aws_session_token": "token",
            "region": "region_name", "profile_name": "profile"}


@dataclasses.dataclass(frozen=True, repr=False)
class S3Options(StoreOptions):
    """The settings of one client and its transfers (see the module docstring for each); its repr shows
    no credential (``storage/credentials.py``)."""

    key: str | None = None
    secret: str | None = None
    token: str | None = None
    profile: str | None = None
    anon: bool = False
    endpoint_url: str | None = None
    region_name: str | None = None
    addressing_style: str | None = None
    connect_timeout: float = 5.0
    read_timeout: float = 60.0

    scheme = "s3"

    @classmethod
    def of(cls, options: Mapping[str, Any] | None) -> S3Options:
        """The options a caller's ``storage_options`` give (the environment fills in the rest, in the client)."""
        given = dict(options or {})
        for k, v in (given.pop("client_kwargs", None) or {}).items():
            if k not in ("endpoint_url", "region_name"):
                raise CheckpointError(f"storage_options: client_kwargs[{k!r}] is not taken (endpoint_url and "
                                      "region_name are)")
            given.setdefault(k, v)
        for old, new in _ALIASES.items():
            if old in given:
                given.setdefault(new, given.pop(old))
        cls.refuse_unknown(given)
        out = cls(**given)
        out.check_bounds()
        out._check_credentials()
        if out.upload_part_size < MIN_PART:
            raise CheckpointError(f"storage_options: upload_part_size must be at least {MIN_PART} bytes (5 MiB), "
                                  "as S3 requires of multipart uploads")
        return out

    def _check_credentials(self) -> None:
        """Credentials are used as given or refused: never one of them dropped silently."""
        if self.anon and (self.key is not None or self.secret is not None or self.token is not None):
            raise CheckpointError("storage_options: anon=True sends unsigned requests, so the key, secret or "
                                  "token given would be ignored; give either anon=True or credentials")
        if (self.key is None) != (self.secret is None):
            given, missing = ("key", "secret") if self.secret is None else ("secret", "key")
            raise CheckpointError(f"storage_options: {given!r} was given without {missing!r}; give both (and "
                                  "'token' for temporary credentials), or neither to use the environment's")
        if self.token is not None and self.key is None:
            raise CheckpointError("storage_options: 'token' was given without 'key' and 'secret'. A session token "
                                  "is valid only with the key pair it was issued with, so it cannot be combined "
                                  "with credentials from the environment or a profile: give key, secret and token "
                                  "together in storage_options, or set AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY "
                                  "and AWS_SESSION_TOKEN")


def parse_url(url: str) -> tuple[str, str]:
    """``(bucket, prefix)`` of ``s3://BUCKET/PREFIX`` (the prefix without slashes at either end; may be empty)."""
    return bucket_and_prefix(url)


def boto() -> tuple[Any, Any]:
    """``(boto3, botocore)``, imported on first use: ``import mmapckpt`` never imports them.

    Raises:
        CheckpointError: the ``s3`` extra is not installed.
    """
    try:
        import boto3
        import botocore
        import botocore.config  # noqa: F401
        import botocore.exceptions  # noqa: F401
    except ImportError:
        raise CheckpointError("s3:// checkpoints need the s3 extra (boto3): pip install 'mmapckpt[s3]'") from None
    return boto3, botocore


_clients = Clients()


def _environment() -> tuple[str | None, ...]:
    names = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
             "AWS_SESSION_TOKEN", "AWS_REGION", "AWS_DEFAULT_REGION", "AWS_PROFILE", "AWS_CONFIG_FILE",
             "AWS_SHARED_CREDENTIALS_FILE")
    return tuple(os.environ.get(n) for n in names)


def client_for(opts: S3Options) -> Any:
    """A boto3 S3 client for ``opts`` and the current environment, made once and shared (boto3's
    clients are thread-safe; its sessions are not, so each client gets its own)."""
    return _clients.get((opts, _environment()), lambda: _make_client(opts))


def _make_client(opts: S3Options) -> Any:
    boto3, botocore = boto()
    session = boto3.session.Session(profile_name=opts.profile) if opts.profile else boto3.session.Session()
    endpoint = opts.endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    region = opts.region_name or os.environ.get("AWS_REGION") or session.region_name or "us-east-1"
    style = opts.addressing_style or ("path" if endpoint else "auto")
    config = botocore.config.Config(
        region_name=region,
        s3={"addressing_style": style},
        # the bounded retries of botocore's standard mode (timeouts, 5xx, throttling), on every call
        retries={"total_max_attempts": opts.retries + 1, "mode": "standard"},
        connect_timeout=opts.connect_timeout, read_timeout=opts.read_timeout,
        max_pool_connections=max(opts.concurrency, opts.upload_concurrency) * 2 + 4,
        # shards carry their own CRC-32s; the aws-chunked trailing checksums of newer clients
        # cost CPU and are refused by many S3-compatible stores
        request_checksum_calculation="when_required", response_checksum_validation="when_required",
        signature_version=botocore.UNSIGNED if opts.anon else None,
    )
    kwargs: dict[str, Any] = {"config": config}
    if endpoint:
        kwargs["endpoint_url"] = endpoint
    if opts.key is not None:  # with its secret, and the token issued with them if any (S3Options.of checked)
        kwargs.update(aws_access_key_id=opts.key, aws_secret_access_key=opts.secret, aws_session_token=opts.token)
    client = session.client("s3", **kwargs)
    quick_acks(client)
    return client
