"""The ETag check of one read of an object: single-PUT and multipart ETags as a real S3 server
(SeaweedFS) computes them, flipped bytes, and ETags that cannot tell."""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import pytest

from shardkit.storage.etag import EtagCheck
from shardkit.storage.store import Store

MIB = 2**20


def feed(check: EtagCheck, data: bytes, piece: int = 3 * MIB + 7) -> bool | None:
    for lo in range(0, len(data), piece):
        check.update(data[lo:lo + piece])
    return check.verdict()


def flipped(data: bytes, at: int) -> bytes:
    out = bytearray(data)
    out[at] ^= 0xFF
    return bytes(out)


def test_md5_etag_of_the_empty_object_and_a_flip() -> None:
    # RFC 1321's test suite: MD5("") = d41d8cd98f00b204e9800998ecf8427e.
    assert EtagCheck('"d41d8cd98f00b204e9800998ecf8427e"', 0).verdict() is True
    data = b"abc" * 1000
    etag = hashlib.md5(data).hexdigest()
    assert feed(EtagCheck(etag, len(data)), data) is True
    assert feed(EtagCheck(etag, len(data)), flipped(data, 1234)) is False
    assert feed(EtagCheck(etag, len(data)), data[:-1]) is False  # short read


@pytest.mark.parametrize("etag", [None, "", "W/\"xyz\"", "0123456789abcdef-2", "a" * 31, '"' + "b" * 32 + '-0"'])
def test_etags_that_cannot_tell_say_so(etag: str | None) -> None:
    check = EtagCheck(etag, 10 * MIB)
    assert not check.checkable
    assert feed(check, b"x" * 100) is None


def multipart(client: Any, bucket: str, key: str, data: bytes, part: int) -> str:
    """Upload ``data`` in parts of ``part`` bytes; the object's ETag."""
    up = client.create_multipart_upload(Bucket=bucket, Key=key)
    parts = []
    for n, lo in enumerate(range(0, len(data), part), start=1):
        r = client.upload_part(Bucket=bucket, Key=key, UploadId=up["UploadId"], PartNumber=n, Body=data[lo:lo + part])
        parts.append({"PartNumber": n, "ETag": r["ETag"]})
    client.complete_multipart_upload(Bucket=bucket, Key=key, UploadId=up["UploadId"],
                                     MultipartUpload={"Parts": parts})
    return str(client.head_object(Bucket=bucket, Key=key)["ETag"])


@pytest.mark.s3
def test_single_put_and_multipart_etags_from_a_real_server(s3_bucket: str, s3_server: Any) -> None:
    store = Store(f"{s3_bucket}/etag", s3_server.storage_options())
    client = store.boto3_client()
    bucket, prefix = store.bucket_key("")
    data = np.random.default_rng(3).bytes(2 * 8 * MIB + 12345)
    client.put_object(Bucket=bucket, Key=f"{prefix}/one", Body=data[:MIB])
    one = store.info("one")
    assert feed(EtagCheck(one["ETag"], one["size"]), data[:MIB]) is True
    assert feed(EtagCheck(one["ETag"], one["size"]), flipped(data[:MIB], 77)) is False

    etag = multipart(client, bucket, f"{prefix}/multi", data, 8 * MIB)  # 3 parts, boto3's part size
    assert etag.strip('"').endswith("-3")
    assert feed(EtagCheck(etag, len(data)), data) is True
    assert feed(EtagCheck(etag, len(data)), flipped(data, 9 * MIB)) is False
