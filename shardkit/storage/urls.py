"""Credentials in URLs: hiding them in anything printed, and refusing URLs that carry them.

Two kinds: userinfo (``s3://KEY:SECRET@bucket/ds``) and the signing parameters of presigned
URLs and shared-access signatures (``X-Amz-Credential``, ``X-Amz-Signature``,
``X-Amz-Security-Token``, ``X-Goog-*``, ``Signature=``, Azure's ``sig=``).
"""

from __future__ import annotations

import re

from shardkit.errors import ConfigError

__all__ = ["SIGNING_PARAMETERS", "redact_secrets", "redact_url", "refuse_url_credentials"]

#: Query parameters that carry a credential or a signature (matched without regard to case):
#: AWS SigV4 and V2 presigned URLs, GCS signed URLs, Azure SAS tokens.
SIGNING_PARAMETERS = ("X-Amz-Credential", "X-Amz-Signature", "X-Amz-Security-Token", "X-Goog-Credential",
                      "X-Goog-Signature", "AWSAccessKeyId", "Signature", "sig")
# A parameter's value runs to the next '&', '#', quote, whitespace or closing bracket: the
# same pattern redacts a bare URL and a URL quoted inside any message.
_SIGNED = re.compile(r"(?i)([?&;](?:" + "|".join(map(re.escape, SIGNING_PARAMETERS)) + r")=)[^&#\s'\"<>)\]]*")


def redact_secrets(text: str) -> str:
    """``text`` with the value of every signing query parameter (:data:`SIGNING_PARAMETERS`)
    replaced by ``***``, wherever a URL holding one appears in it.

    Args:
        text: a URL, or any message that may quote one.

    Returns:
        The text safe to print or store; ``text`` itself when it holds no such parameter.
    """
    return _SIGNED.sub(r"\1***", text) if "=" in text else text


# Schemes whose first path part is a bucket name, which never holds ':'.
_BUCKET_SCHEMES = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss"})


def _userinfo_span(part: str) -> tuple[int, int] | None:
    """(start, end) of the ``user:secret`` before an ``@`` in one URL (no ``::`` chain), or None."""
    scheme, sep, rest = part.partition("://")
    if not sep:
        return None
    at = rest.find("@")
    if at < 0:
        return None
    head = rest[:at]
    start = len(scheme) + len(sep)
    if "/" not in head:
        return start, start + at
    # An AWS secret key may hold '/', which moves the '@' past the first '/'
    # (s3://AKID:abc/def@bucket/ds); a bucket name never holds ':', so a ':' in the first
    # part still means key:secret. Elsewhere an '@' after the first '/' is part of the path.
    if scheme.lower() in _BUCKET_SCHEMES and ":" in head.split("/", 1)[0]:
        return start, start + at
    return None


def redact_url(url: str) -> str:
    """``url`` with any userinfo (``key:secret@``) and the values of signing query parameters
    (:func:`redact_secrets`) replaced by ``***``, chained parts included.

    Args:
        url: any URL, possibly an fsspec chain (``simplecache::s3://...``).

    Returns:
        The URL safe to print; ``url`` itself when it holds no userinfo.
    """
    parts = []
    for part in url.split("::"):
        span = _userinfo_span(part)
        parts.append(part if span is None else part[:span[0]] + "***" + part[span[1]:])
    return redact_secrets("::".join(parts))


def refuse_url_credentials(url: str, what: str = "URL") -> None:
    """Refuse credentials written into a URL (``s3://KEY:SECRET@bucket/ds``, or a presigned
    URL's ``X-Amz-Signature=...``).

    They would be repeated by every message and log line that names the URL (and stored in
    dataset.json and a pack's claim), so they are refused up front, and the message shows the
    URL with them replaced by ``***``. A presigned URL also expires, in the middle of a long pack.

    Args:
        url: the URL a user gave.
        what: how the message names it (``"URL"``, ``"source"``...).

    Raises:
        ConfigError: ``url`` holds userinfo.
    """
    if redact_secrets(url) != url:
        raise ConfigError(f"{what} {redact_url(url)}: presigned or signed URLs are refused (the signature expires, "
                          "and it would be stored in dataset.json and shown in errors and logs); give the plain URL "
                          "and the credentials in the AWS_* environment variables, a profile (AWS_PROFILE) or "
                          "storage_options")
    if redact_url(url) != url:
        raise ConfigError(f"{what} {redact_url(url)}: credentials in the URL are refused (they would show in "
                          "errors and logs); give them in the AWS_* environment variables, a profile "
                          "(AWS_PROFILE) or storage_options")
