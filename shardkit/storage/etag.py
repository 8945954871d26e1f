"""Checking the bytes of one read of an object against its ETag, the MD5 S3 computed at upload.

A byte corrupted in transit (a NIC, a proxy, a TLS-terminating middlebox) passes TCP's weak
checksum now and then; a writer that records checksums of what it read (``shardkit index``)
would then commit the corruption as the truth. S3's ETag of an object uploaded in one PUT is
the MD5 of its bytes; of a multipart upload, ``md5(md5(part 1) + ... + md5(part N))-N``, which
needs the part size: the common part sizes that fit N parts are tried, at most
:data:`MAX_CANDIDATES` of them. An ETag of another form (server-side encryption with KMS, a
store that computes it otherwise) cannot tell, and says so (``None``), never a false "corrupt".
"""

from __future__ import annotations

import hashlib
import logging
import re
from typing import Any, Callable, TypeVar

from shardkit.errors import IntegrityError

__all__ = ["COMMON_PART_SIZES", "CONFIRMING_READS", "MAX_CANDIDATES", "EtagCheck", "confirmed_read"]

log = logging.getLogger(__name__)
T = TypeVar("T")

CONFIRMING_READS = 3  # reads of an object whose bytes the ETag does not confirm, at most

_MIB = 2**20
# Part sizes uploaders use: boto3/aws-cli 8 MiB, S3's 5 MiB minimum, s3fs 50 MiB, and the
# powers of two many tools pick; shardkit's own writer's parts are among them.
COMMON_PART_SIZES = tuple(n * _MIB for n in (5, 8, 16, 32, 50, 64, 100, 128, 256, 512, 1024))
MAX_CANDIDATES = 3  # each candidate part size costs one MD5 pass over the bytes
_ETAG = re.compile(r'^"?([0-9a-fA-F]{32})(?:-(\d+))?"?$')


class _Parts:
    """The multipart ETag of the bytes seen, for one part size."""

    def __init__(self, part_size: int) -> None:
        self.part_size = part_size
        self.digests: list[bytes] = []
        self._md5 = hashlib.md5(usedforsecurity=False)
        self._in_part = 0

    def update(self, data: memoryview) -> None:
        while data.nbytes:
            take = min(data.nbytes, self.part_size - self._in_part)
            self._md5.update(data[:take])
            self._in_part += take
            data = data[take:]
            if self._in_part == self.part_size:
                self._close()

    def _close(self) -> None:
        self.digests.append(self._md5.digest())
        self._md5 = hashlib.md5(usedforsecurity=False)
        self._in_part = 0

    def etag(self) -> str:
        if self._in_part:
            self._close()
        return f"{hashlib.md5(b''.join(self.digests), usedforsecurity=False).hexdigest()}-{len(self.digests)}"


class EtagCheck:
    """Feed it every byte of one read of an object, in order; :meth:`verdict` says whether
    they are the bytes the ETag was computed from.

    Args:
        etag: the object's ETag as the store reports it (quotes allowed); None or any other
            form: the check cannot tell.
        size: the object's size in bytes.
    """

    def __init__(self, etag: str | None, size: int) -> None:
        self.etag = etag
        self._want: str | None = None
        self._whole: Any = None
        self._parts: list[_Parts] = []
        self._seen = 0
        self.size = size
        match = _ETAG.match(etag.strip()) if etag else None
        if match is None:
            return
        digest, parts = match.group(1).lower(), match.group(2)
        if parts is None:
            self._want = digest
            self._whole = hashlib.md5(usedforsecurity=False)
            return
        n = int(parts)
        fits = [p for p in COMMON_PART_SIZES if n >= 1 and (n - 1) * p < size <= n * p]
        if fits:
            self._want = f"{digest}-{n}"
            self._parts = [_Parts(p) for p in fits[:MAX_CANDIDATES]]

    @property
    def checkable(self) -> bool:
        """Whether the ETag can tell (an MD5, or a multipart ETag with a part size that fits)."""
        return self._want is not None

    def update(self, data: bytes | memoryview) -> None:
        """Take the next bytes of the read.

        Args:
            data: the bytes that follow the ones seen so far.
        """
        if self._want is None:
            return
        view = memoryview(data)
        self._seen += view.nbytes
        if self._whole is not None:
            self._whole.update(view)
        for parts in self._parts:
            parts.update(view)

    def verdict(self) -> bool | None:
        """Whether the bytes seen are the object's.

        Returns:
            True: they match the ETag; False: they do not (or fewer/more bytes than ``size``
            were seen); None: the ETag cannot tell (see the module docstring).
        """
        if self._want is None:
            return None
        if self._seen != self.size:
            return False
        if self._whole is not None:
            return bool(self._whole.hexdigest() == self._want)
        return any(p.etag() == self._want for p in self._parts)


def confirmed_read(read: Callable[[], tuple[T, bool | None, str]], what: str, *,
                   malformed: tuple[type[Exception], ...] = ()) -> T:
    """Read an object until its bytes are trusted: the ETag agrees, or cannot tell, or (after a
    mismatch: an ETag that is no MD5 of the bytes, KMS encryption, another store's scheme) two
    reads give the same bytes.

    Args:
        read: one read: (its result, :meth:`EtagCheck.verdict` of its bytes, a digest of them).
        what: the object, for messages.
        malformed: errors a read may raise over bytes it found malformed; one is raised only
            when a second read finds the same (a byte flipped in transit can break a header).

    Returns:
        The result of the trusted read.

    Raises:
        IntegrityError: :data:`CONFIRMING_READS` reads gave different bytes or faults.
        Exception: one of ``malformed`` that two reads raised alike.
    """
    seen: list[str] = []
    faults: list[str] = []
    for _ in range(CONFIRMING_READS):
        try:
            value, verdict, digest = read()
        except malformed as exc:
            if str(exc) in faults:
                raise  # the same fault on two reads: the object's, not the transfer's
            faults.append(str(exc))
            log.warning("%s; reading it again in case a byte was corrupted in transit", exc)
            continue
        if verdict is not False or digest in seen:
            return value
        seen.append(digest)
        log.warning("%s: the bytes read do not match its ETag; reading it again", what)
    why = f" or faults ({'; '.join(faults[:2])})" if faults else ""
    raise IntegrityError(f"{what}: {CONFIRMING_READS} reads gave different bytes{why}, none matching its ETag; the "
                         "network or the store corrupts data: check it, then retry")
