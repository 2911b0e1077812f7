"""Credentials against the real radosgw: never shown, and used exactly as given or refused.

- Every object that holds storage_options (MmapReader, MmapWriter, the S3 storage and its options, an open file,
  LazyCheckpoint), walked attribute by attribute, every error (wrong secret, missing object, refused option),
  every log record and warning, and the CLI's stdout and stderr (in-process and as a subprocess) show neither the
  secret, nor the session token, nor the whole access key id (storage/credentials.py).
- A token given with its key pair in storage_options is sent on every request (X-Amz-Security-Token, seen by a
  botocore ``before-send`` hook on mmapckpt's own client: the request as it goes on the wire); a token given
  alone, with the pair from the environment, is refused before any request; the environment's token goes with
  the environment's pair only.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import traceback
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import mmapckpt
from mmapckpt import CheckpointError, MmapReader, MmapWriter, StorageAccessError
from mmapckpt.storage.s3.options import S3Options, client_for
from mmapckpt.tools.cli import main

warnings.filterwarnings("ignore", message="torch.distributed is disabled")

TOKEN = "FwoGZXIvYXdzEXAMPLE-SESSION-TOKEN-0123456789"
WRONG_SECRET = "not-the-secret-ZYXWVUTSRQ-9876543210"
#: the credential fields of S3Options: the walk below does not show their (intentionally kept) values
_FIELDS = {"key", "secret", "token"}


def _never(env: dict[str, str]) -> list[str]:
    """What must appear nowhere: the secrets, the token, the whole key id (and long pieces of each)."""
    out = []
    for s in (env["AWS_SECRET_ACCESS_KEY"], WRONG_SECRET, TOKEN, env["AWS_ACCESS_KEY_ID"]):
        out += [s, s[:12], s[-12:]]
    return out


def _clean(text: str, env: dict[str, str], what: str = "") -> None:
    for s in _never(env):
        assert s not in text, f"{what}: {s!r} shown in {text[:2000]!r}"


def _shown(obj: Any, where: str, depth: int = 5, seen: set[int] | None = None) -> Iterator[tuple[str, str]]:
    """(where, text): repr and str of ``obj`` and of everything reachable through the attributes of mmapckpt's
    objects."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return
    seen.add(id(obj))
    yield where, repr(obj)
    yield where, str(obj)
    if depth == 0 or not type(obj).__module__.startswith("mmapckpt") or isinstance(obj, Mapping):
        return  # a mapping of mmapckpt's (StorageOptions) is shown by its repr; its values are what it keeps
    attrs = dict(getattr(obj, "__dict__", {}))
    for slot in getattr(type(obj), "__slots__", ()):
        if hasattr(obj, slot):
            attrs[slot] = getattr(obj, slot)
    for name, value in attrs.items():
        if name not in _FIELDS:
            yield from _shown(value, f"{where}.{name}", depth - 1, seen)


@pytest.fixture
def watch() -> Iterator[Any]:
    """``watch(client)``: the headers of every request ``client`` sends from then on (a ``before-send`` hook, which
    runs after signing: the request as it goes on the wire); the hooks are removed after the test (clients are
    shared between tests)."""
    hooks: list[tuple[Any, Any]] = []

    def watch_client(client: Any) -> list[dict[str, str]]:
        sent: list[dict[str, str]] = []

        def hook(request: Any, **_: Any) -> None:
            sent.append({k.lower(): v.decode() if isinstance(v, bytes) else v for k, v in request.headers.items()})

        client.meta.events.register("before-send.s3", hook)
        hooks.append((client, hook))
        return sent

    yield watch_client
    for client, hook in hooks:
        client.meta.events.unregister("before-send.s3", hook)


def test_nothing_shows_a_credential(s3_env, s3_bucket, tmp_path, caplog, capsys, recwarn, monkeypatch):
    caplog.set_level(logging.DEBUG, logger="mmapckpt")
    opts = {"key": s3_env["AWS_ACCESS_KEY_ID"], "secret": s3_env["AWS_SECRET_ACCESS_KEY"], "part_size": 1 << 20}
    url = f"s3://{s3_bucket}/shown"
    sd = {"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(3)}
    writer = MmapWriter(url, storage_options=opts)
    dcp.save(sd, storage_writer=writer, no_dist=True)
    reader = MmapReader(url, storage_options=opts)
    got = {n: torch.zeros_like(t) for n, t in sd.items()}
    dcp.load(got, storage_reader=reader, no_dist=True)
    assert torch.equal(got["w"], sd["w"])
    shown: list[tuple[str, str]] = []
    with mmapckpt.open(url, storage_options=opts) as lazy:
        lazy.get_tensor("w")
        storage = reader.storage
        with storage.open_file(".metadata") as f:
            for name, obj in (("writer", writer), ("reader", reader), ("lazy", lazy), ("storage", storage),
                              ("file", f), ("client config", storage.client.meta.config)):
                shown += _shown(obj, name)
    # errors built where credentials were given: refused ones, a missing object, a refused option
    errors: list[BaseException] = []
    for call in (lambda: mmapckpt.load(url, storage_options={**opts, "secret": WRONG_SECRET}),
                 lambda: mmapckpt.load(f"{url}-none", storage_options=opts),
                 lambda: mmapckpt.save(sd, url, storage_options={**opts, "secret": WRONG_SECRET}),
                 lambda: mmapckpt.load(url, storage_options={"token": TOKEN}),
                 lambda: mmapckpt.load(url, storage_options={**opts, "secrett": WRONG_SECRET})):
        with pytest.raises(CheckpointError) as ei:
            call()
        errors.append(ei.value)
    assert isinstance(errors[0], StorageAccessError) and isinstance(errors[2], StorageAccessError)
    with pytest.raises(BaseException) as ei:  # through DCP's wrapping
        dcp.load(got, storage_reader=MmapReader(url, storage_options={**opts, "secret": WRONG_SECRET}), no_dist=True)
    errors.append(ei.value)
    for i, e in enumerate(errors):
        shown += [(f"error {i}", text) for text in (str(e), repr(e), "".join(traceback.format_exception(e)))]
    shown += [(f"log {r.name}", r.getMessage()) for r in caplog.records]
    shown += [("warning", str(w.message)) for w in recwarn]
    for where, text in shown:
        _clean(text, s3_env, where)
    assert any("secret='***'" in s for _, s in shown) and any("MmapReader(" in s for _, s in shown)
    assert "key='****" in repr(storage.opts)
    # the CLI reads credentials from the environment: a wrong secret there, then the right one
    out = tmp_path / "out"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", WRONG_SECRET)
    capsys.readouterr()
    for argv in (["inspect", url], ["verify", url], ["convert", url, str(out)]):
        assert main(argv) != 0
        o = capsys.readouterr()
        _clean(o.out + o.err, s3_env, f"CLI {argv}")
        assert "refused the credentials" in o.out + o.err
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_env["AWS_SECRET_ACCESS_KEY"])
    for argv in (["inspect", url], ["verify", url], ["convert", url, str(out)]):
        assert main(argv) == 0, argv
        o = capsys.readouterr()
        _clean(o.out + o.err, s3_env, f"CLI {argv}")
    # the command itself, as a user runs it; --debug prints the whole traceback (botocore's error chained)
    for secret, debug in ((WRONG_SECRET, []), (WRONG_SECRET, ["--debug"]), (s3_env["AWS_SECRET_ACCESS_KEY"], [])):
        env = {**os.environ, "AWS_SECRET_ACCESS_KEY": secret, "PYTHONPATH": os.pathsep.join(sys.path)}
        run = subprocess.run([sys.executable, "-m", "mmapckpt", *debug, "inspect", url], env=env,
                             capture_output=True, text=True, timeout=120)
        assert (run.returncode == 0) == (secret != WRONG_SECRET), run.stderr
        assert not debug or "Traceback" in run.stderr
        _clean(run.stdout + run.stderr, s3_env, "CLI subprocess")


def test_a_token_given_with_its_key_pair_is_sent_on_every_request(s3_env, s3_bucket, watch):
    url = f"s3://{s3_bucket}/token"
    mmapckpt.save({"a": torch.arange(5)}, url)
    opts = {"key": s3_env["AWS_ACCESS_KEY_ID"], "secret": s3_env["AWS_SECRET_ACCESS_KEY"], "token": TOKEN}
    reader = MmapReader(url, storage_options=opts)
    sent = watch(reader.storage.client)
    # radosgw 16.2 without STS checks the signature and ignores a token it did not issue: the load succeeds
    # (a store that checks tokens, as AWS does, would refuse a wrong one: StorageAccessError)
    got = {"a": torch.zeros(5, dtype=torch.int64)}
    dcp.load(got, storage_reader=reader, no_dist=True)
    assert got["a"].tolist() == list(range(5))
    assert sent, "no request was sent"
    assert all(h.get("x-amz-security-token") == TOKEN for h in sent), sent
    assert all(s3_env["AWS_ACCESS_KEY_ID"] in h["authorization"] for h in sent)  # signed with the pair given
    before = len(sent)  # the same client serves every entry point with these options
    assert mmapckpt.load(url, storage_options=opts)["a"].tolist() == list(range(5))
    mmapckpt.save({"a": torch.arange(6)}, url, storage_options=opts)
    assert len(sent) > before and all(h.get("x-amz-security-token") == TOKEN for h in sent)


def test_a_token_alone_is_refused_before_any_request(s3_env, s3_bucket, watch):
    """The issue's case: key and secret in the environment, a token in storage_options (it was dropped and the
    load succeeded without it): refused, saying to pass all three or set AWS_SESSION_TOKEN."""
    url = f"s3://{s3_bucket}/alone"
    mmapckpt.save({"a": torch.arange(5)}, url)
    sent = watch(client_for(S3Options.of(None)))
    for call in (lambda: mmapckpt.load(url, storage_options={"token": TOKEN}),
                 lambda: MmapReader(url, storage_options={"token": TOKEN}).read_metadata(),
                 lambda: mmapckpt.save({"a": torch.ones(2)}, url, storage_options={"aws_session_token": TOKEN})):
        with pytest.raises(CheckpointError, match="'token' was given without 'key' and 'secret'.*AWS_SESSION_TOKEN"):
            call()
    assert sent == []
    assert mmapckpt.load(url)["a"].tolist() == list(range(5))  # untouched


def test_the_environments_token_goes_with_the_environments_key_pair_only(s3_env, s3_bucket, monkeypatch, watch):
    url = f"s3://{s3_bucket}/envtoken"
    mmapckpt.save({"a": torch.arange(5)}, url)
    monkeypatch.setenv("AWS_SESSION_TOKEN", TOKEN)
    sent = watch(client_for(S3Options.of(None)))  # the client of the environment now (its token included)
    assert mmapckpt.load(url)["a"].tolist() == list(range(5))  # radosgw ignores a token it did not issue
    assert sent and all(h.get("x-amz-security-token") == TOKEN for h in sent), sent
    opts = {"key": s3_env["AWS_ACCESS_KEY_ID"], "secret": s3_env["AWS_SECRET_ACCESS_KEY"]}
    sent = watch(client_for(S3Options.of(opts)))
    assert mmapckpt.load(url, storage_options=opts)["a"].tolist() == list(range(5))
    assert sent and all("x-amz-security-token" not in h for h in sent), sent
