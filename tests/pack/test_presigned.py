"""Presigned and signed URLs (AWS SigV4/V2, GCS, Azure SAS) are refused as pack sources and
destinations in one line that shows no secret, before anything is written: nothing of them
reaches dataset.json, ``_pack/plan.json``, a message or a log."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

import shardkit
from shardkit.cli import main as cli_main
from shardkit.errors import ConfigError
from shardkit.packing.index import index_tars
from shardkit.packing.sources import WdsTarSource
from shardkit.storage.store import Store
from shardkit.storage.urls import redact_secrets, redact_url

SECRETS = ("AKIASECRETKEYID", "SIGSECRET0123", "TOKENSECRET", "GOOGSECRET", "AZSIGSECRET", "V2SECRET")
AWS = ("https://bucket.s3.amazonaws.com/shards/s-000.tar?X-Amz-Algorithm=AWS4-HMAC-SHA256"
       "&X-Amz-Credential=AKIASECRETKEYID%2F20260101%2Fus-east-1%2Fs3%2Faws4_request&X-Amz-Date=20260101T000000Z"
       "&X-Amz-Expires=3600&X-Amz-SignedHeaders=host&X-Amz-Security-Token=TOKENSECRET&X-Amz-Signature=SIGSECRET0123")
GCS = "https://storage.googleapis.com/b/s.tar?X-Goog-Algorithm=GOOG4-RSA-SHA256&X-Goog-Credential=x&X-Goog-Signature=GOOGSECRET"
AZURE = "https://acct.blob.core.windows.net/c/s.tar?sv=2022-11-02&se=2026-01-01&sp=r&sig=AZSIGSECRET"
AWS_V2 = "https://b.s3.amazonaws.com/s.tar?AWSAccessKeyId=AKIASECRETKEYID&Expires=1&Signature=V2SECRET"
SIGNED = [AWS, GCS, AZURE, AWS_V2]


def _clean(text: str) -> None:
    for secret in SECRETS:
        assert secret not in text, text


@pytest.mark.parametrize("url", SIGNED)
def test_redaction_hides_every_signing_parameter(url):
    for text in (url, f"cannot read {url!r}: 403", f"({url})", url.replace("X-Amz", "x-amz")):
        _clean(redact_secrets(text))
        _clean(redact_url(text))
    assert "X-Amz-Date=20260101T000000Z" in redact_secrets(AWS)  # what is no secret stays readable
    assert redact_secrets("s3://b/ds/a=b.tar?versionId=3") == "s3://b/ds/a=b.tar?versionId=3"


@pytest.mark.parametrize("url", SIGNED)
def test_pack_refuses_a_signed_source_in_one_line(tmp_path, url, caplog):
    caplog.set_level(logging.DEBUG)
    for source in (url, url.replace("s-000.tar", "s-{000..003}.tar").replace("/s.tar", "/s-{0..3}.tar")):
        with pytest.raises(ConfigError, match="presigned or signed URLs are refused") as err:
            shardkit.pack(source, str(tmp_path / "ds"), progress=False)
        assert "\n" not in str(err.value)
        _clean(str(err.value))
    with pytest.raises(ConfigError, match="presigned"):
        WdsTarSource([url])
    assert not (tmp_path / "ds").exists()  # no dataset.json, no _pack/plan.json
    _clean(caplog.text)


def test_cli_pack_refuses_it_and_prints_no_secret(tmp_path, capsys):
    assert cli_main(["pack", AWS, str(tmp_path / "ds")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "presigned or signed URLs are refused" in err
    _clean(err)
    assert not (tmp_path / "ds").exists()


def test_signed_destination_refused(tmp_path):
    for url in (AWS.replace("/shards/s-000.tar", "/ds"), AZURE):
        with pytest.raises(ConfigError, match="presigned") as err:
            Store(url)
        _clean(str(err.value))
        with pytest.raises(ConfigError, match="presigned") as err:
            index_tars(url, progress=False)
        _clean(str(err.value))


@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_file_list_row_with_a_signed_url_refused_not_stored(tmp_path, on_error):
    (tmp_path / "a.txt").write_text("a")
    listing = tmp_path / "list.csv"
    listing.write_text(f"path,label\na.txt,0\n{AZURE},1\n")
    with pytest.raises(ConfigError, match=r"list.csv: row 1: 'path' .*presigned") as err:
        shardkit.pack(str(listing), str(tmp_path / "ds"), on_error=on_error, progress=False)
    _clean(str(err.value))
    assert not (tmp_path / "ds").exists()  # was: skipped with the URL in dataset.json's "skipped"


def test_cli_redacts_a_signed_url_in_any_error(tmp_path, capsys, monkeypatch):
    import shardkit.packing.index as index_module

    def boom(*args: object, **kwargs: object) -> None:
        raise OSError(f"cannot open {AWS}")

    monkeypatch.setattr(index_module, "index_tars", boom)
    assert cli_main(["index", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "X-Amz-Signature=***" in err
    _clean(err)


def test_plain_urls_still_accepted(tmp_path):
    assert WdsTarSource(["https://host/b/s-000.tar?versionId=3", "s3://b/s-{000..001}.tar"]).urls[0].endswith("=3")
    Store(str(Path(tmp_path)))
