"""az:// URLs and options: the schemes taken, credentials from one place, refused mixtures, nothing secret shown."""

from __future__ import annotations

import pytest

from mmapckpt import CheckpointError
from mmapckpt.storage.azure.options import AzureOptions, parse_url
from mmapckpt.storage.credentials import StorageOptions


def test_az_and_abfs_urls():
    assert parse_url("az://c/run/7/") == ("c", "run/7", None)
    assert parse_url("abfs://c@acct.dfs.core.windows.net/p") == ("c", "p", "acct")
    with pytest.raises(CheckpointError, match="needs a container"):
        parse_url("az:///p")


def test_the_environment_fills_in_only_where_the_options_give_no_credentials(monkeypatch):
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT", "envacct")
    monkeypatch.setenv("AZURE_STORAGE_KEY", "ZW52a2V5")
    env = AzureOptions.of({})
    assert (env.account_name, env.account_key) == ("envacct", "ZW52a2V5")
    given = AzureOptions.of({"sas_token": "sv=1&sig=abc"})
    assert given.account_key is None and given.sas_token == "sv=1&sig=abc"  # the env's key is not mixed in


@pytest.mark.parametrize("bad", [{"anon": True, "account_key": "k"}, {"account_key": "k", "sas_token": "s"},
                                 {"acount_key": "k"}])
def test_mixtures_and_misspellings_are_refused(bad):
    with pytest.raises(CheckpointError):
        AzureOptions.of(bad)


def test_connection_strings_keys_and_sas_tokens_are_not_shown():
    options = {"connection_string": "AccountName=a;AccountKey=SECRETKEY", "account_key": "SECRETKEY2",
               "sas_token": "sig=SECRETSIG"}
    for shown in (repr(StorageOptions(options)), repr(AzureOptions(**options))):
        assert "SECRET" not in shown, shown
