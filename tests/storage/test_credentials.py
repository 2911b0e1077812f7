"""The one redaction rule for credentials (storage/credentials.py) and the rule that credentials are used as given
or refused (storage/s3/options.py), without a server: tests/s3/test_s3_credentials.py checks the same against
radosgw (what is sent, what every object, message, log record and the CLI show)."""

from __future__ import annotations

import copy
import pickle

import pytest

from mmapckpt import CheckpointError, MmapReader, MmapWriter
from mmapckpt.storage.credentials import StorageOptions, redacted
from mmapckpt.storage.s3.options import S3Options

KEY = "AKIAIOSFODNN7EXAMPLE"
SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
TOKEN = "FwoGZXIvYXdzEXAMPLETOKEN//////////wEaDM3zNRwcHt+SESSIONTOKEN"
#: every form of the credentials that must never be shown (the key id in full; its last four characters may be)
NEVER = (KEY, SECRET, TOKEN, SECRET[:12], TOKEN[:12], KEY[:10])


def _clean(text: str) -> None:
    for s in NEVER:
        assert s not in text, f"{s!r} shown in {text!r}"


def test_s3_options_repr_shows_no_credential_but_the_key_ids_last_four() -> None:
    o = S3Options.of({"key": KEY, "secret": SECRET, "token": TOKEN, "endpoint_url": "http://u:pw-123@host:9000",
                      "part_size": 1 << 20})
    for text in (repr(o), str(o), f"{o}", repr([o]), repr({"o": o})):
        _clean(text)
        assert "secret='***'" in text and "token='***'" in text and "key='****MPLE'" in text
        assert "pw-123" not in text and "http://u:***@host:9000" in text
        assert "part_size=1048576" in text  # what is not a credential is shown as it is
    assert (o.key, o.secret, o.token) == (KEY, SECRET, TOKEN)  # kept for the client, only not shown


def test_a_short_key_id_is_shown_as_asterisks_only() -> None:
    assert redacted({"key": "ABCDEFGH"}) == {"key": "****"}
    assert redacted({"aws_access_key_id": KEY}) == {"aws_access_key_id": "****MPLE"}


@pytest.mark.parametrize("name", ["secret", "token", "aws_secret_access_key", "aws_session_token", "password",
                                  "api_key", "account_key", "sas_token", "client_secret", "credentials"])
def test_every_name_of_a_secret_is_masked(name: str) -> None:
    assert redacted({name: SECRET}) == {name: "***"}
    assert redacted({"client_kwargs": {name: SECRET}}) == {"client_kwargs": {name: "***"}}
    assert redacted({name: None}) == {name: None}  # "not given" is worth telling


def test_storage_options_of_readers_and_writers_show_redacted(tmp_path) -> None:
    given = {"key": KEY, "secret": SECRET, "token": TOKEN, "client_kwargs": {"aws_secret_access_key": SECRET}}
    for obj in (MmapReader(str(tmp_path), storage_options=given), MmapWriter(str(tmp_path), storage_options=given)):
        for text in (repr(obj), str(obj), repr(obj.storage_options), str(vars(obj)), repr(vars(obj))):
            _clean(text)
        assert "'***'" in repr(obj) and str(tmp_path) in repr(obj)
        assert dict(obj.storage_options) == given  # the values reach the storage unchanged
    opts = StorageOptions(given)
    for again in (pickle.loads(pickle.dumps(opts)), copy.deepcopy(opts)):  # DCP's process-based async saves
        assert isinstance(again, StorageOptions) and dict(again) == given
        _clean(repr(again))


def test_a_token_without_its_key_pair_is_refused() -> None:
    """A session token is valid only with the key pair it was issued with: given alone (the pair from the
    environment) it used to be dropped silently; now refused, saying what to do."""
    with pytest.raises(CheckpointError, match="'token' was given without 'key' and 'secret'.*AWS_SESSION_TOKEN") as ei:
        S3Options.of({"token": TOKEN})
    _clean(str(ei.value))
    with pytest.raises(CheckpointError, match="'token' was given without"):
        S3Options.of({"aws_session_token": TOKEN})
    with pytest.raises(CheckpointError, match="'key' was given without 'secret'") as ei:
        S3Options.of({"key": KEY, "token": TOKEN})
    _clean(str(ei.value))
    with pytest.raises(CheckpointError, match="'secret' was given without 'key'") as ei:
        S3Options.of({"secret": SECRET})
    _clean(str(ei.value))
    with pytest.raises(CheckpointError, match="anon=True") as ei:
        S3Options.of({"anon": True, "key": KEY, "secret": SECRET})
    _clean(str(ei.value))
    # the accepted forms
    assert S3Options.of({"key": KEY, "secret": SECRET, "token": TOKEN}).token == TOKEN
    assert S3Options.of({"key": KEY, "secret": SECRET}).token is None
    assert S3Options.of({"anon": True}).anon


def test_refused_credentials_are_refused_by_every_entry_point(tmp_path) -> None:
    import mmapckpt
    bad = {"token": TOKEN}
    url = "s3://bucket/prefix"
    calls = [lambda: MmapReader(url, storage_options=bad).storage, lambda: MmapWriter(url, storage_options=bad),
             lambda: mmapckpt.load(url, storage_options=bad), lambda: mmapckpt.open(url, storage_options=bad),
             lambda: mmapckpt.save({}, url, storage_options=bad),
             lambda: mmapckpt.convert(url, str(tmp_path / "o"), to="mmapckpt", storage_options=bad)]
    for call in calls:
        with pytest.raises(CheckpointError, match="'token' was given without") as ei:
            call()
        _clean(str(ei.value))
