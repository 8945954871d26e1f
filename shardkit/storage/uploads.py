"""Incomplete S3 multipart uploads: finding those under a prefix and aborting them.

S3 keeps the parts of an upload whose writer died, invisible in listings and billed, until it
is aborted.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterable

__all__ = ["abort_multipart_uploads"]


def _abort_one(fs: Any, bucket: str, key: str, upload_id: str) -> None:
    try:
        fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id)
    except FileNotFoundError:
        pass  # completed or aborted meanwhile (NoSuchUpload)


def abort_multipart_uploads(fs: Any, places: Iterable[tuple[str, str, str]],
                            call: Callable[[Callable[[], Any], str], Any]) -> list[str]:
    """Abort the incomplete multipart uploads whose keys lie under the given prefixes.

    Args:
        fs: an s3fs filesystem (its ``call_s3`` makes the requests).
        places: (folder as messages name it, bucket, key prefix) of each place to clean.
        call: runs one request with retries, naming what it is about
            (:meth:`~shardkit.storage.store.Store.call`).

    Returns:
        The keys aborted.

    Raises:
        StorageError: a request failed (as ``call`` translates it).
    """
    aborted: list[str] = []
    for folder, bucket, prefix in places:
        prefix = prefix.rstrip("/") + "/"
        params: dict[str, Any] = {"Bucket": bucket, "Prefix": prefix}
        while True:
            page = call(functools.partial(fs.call_s3, "list_multipart_uploads", **params),
                        f"{folder}/ (multipart uploads)")
            for up in page.get("Uploads") or []:
                key = up["Key"]
                if key.startswith(prefix):  # a store that ignores Prefix lists the whole bucket
                    call(functools.partial(_abort_one, fs, bucket, key, up["UploadId"]), key)
                    aborted.append(key)
            if not page.get("IsTruncated"):
                break
            params = {"Bucket": bucket, "Prefix": prefix, "KeyMarker": page.get("NextKeyMarker", ""),
                      "UploadIdMarker": page.get("NextUploadIdMarker", "")}
    return aborted
