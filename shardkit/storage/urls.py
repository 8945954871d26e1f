"""Credentials in URLs: hiding them in anything printed, and refusing URLs that carry them."""

from __future__ import annotations

from shardkit.errors import ConfigError

__all__ = ["redact_url", "refuse_url_credentials"]

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
    """``url`` with any userinfo (``key:secret@``) replaced by ``***``, chained parts included.

    Args:
        url: any URL, possibly an fsspec chain (``simplecache::s3://...``).

    Returns:
        The URL safe to print; ``url`` itself when it holds no userinfo.
    """
    parts = []
    for part in url.split("::"):
        span = _userinfo_span(part)
        parts.append(part if span is None else part[:span[0]] + "***" + part[span[1]:])
    return "::".join(parts)


def refuse_url_credentials(url: str, what: str = "URL") -> None:
    """Refuse credentials written into a URL (``s3://KEY:SECRET@bucket/ds``).

    They would be repeated by every message and log line that names the URL, so they are
    refused up front, and the message shows the URL with them replaced by ``***``.

    Args:
        url: the URL a user gave.
        what: how the message names it (``"URL"``, ``"source"``...).

    Raises:
        ConfigError: ``url`` holds userinfo.
    """
    if redact_url(url) != url:
        raise ConfigError(f"{what} {redact_url(url)}: credentials in the URL are refused (they would show in "
                          "errors and logs); give them in the AWS_* environment variables, a profile "
                          "(AWS_PROFILE) or storage_options")
