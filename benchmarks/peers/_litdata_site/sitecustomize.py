"""Loaded (via PYTHONPATH) only in the LitData benchmark process and its spawned workers.

LitData moves data through obstore, which refuses ``http://`` endpoints unless its client
options say ``allow_http``; LitData passes fixed options and ignores AWS_ALLOW_HTTP (seen with litdata 0.2.76).
The benchmark's SeaweedFS is plain HTTP on loopback, so add the option here.
"""

try:
    import litdata.streaming.downloader as _dl

    _dl._OBSTORE_CLIENT_OPTIONS = {**dict(_dl._OBSTORE_CLIENT_OPTIONS), "allow_http": True}
except Exception:  # noqa: BLE001 - never break interpreter start-up; the row reports what fails
    pass
