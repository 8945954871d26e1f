"""ShardWriter: samples -> deterministic WebDataset tar shards + manifest rows.

Shards roll over at a size or a sample count; each is a :class:`~shardkit.packing.tar_shard.TarShard`
streamed to storage in parts through one :class:`~shardkit.packing.upload.Uploader` shared by
all of them, so a shard's last part uploads while the next one fills.
"""

from __future__ import annotations

from typing import Callable

from shardkit.format.rows import SampleRows, ShardRecord, shard_name
from shardkit.format.tar import END_OF_ARCHIVE, member_header, padding
from shardkit.packing.sample import PackSample, StreamedField
from shardkit.packing.tar_shard import PART_BYTES, TarShard
from shardkit.packing.upload import Uploader
from shardkit.storage.store import Store

# PART_BYTES is the shard writer's part size (defined with the shard that uses it).
__all__ = ["PART_BYTES", "ShardWriter", "tar_size"]


def tar_size(sample: PackSample) -> int:
    """The bytes :meth:`TarShard.add` writes for ``sample``: headers, bodies and padding.

    Args:
        sample: the sample.

    Returns:
        Its bytes in a shard.
    """
    total = 0
    for name, value in sample.fields.items():
        size = value.size if isinstance(value, StreamedField) else len(value)
        total += len(member_header(f"{sample.key}.{name}", size)) + size + padding(size)
    return total


class ShardWriter:
    """Streams samples into shards that roll over at ``shard_bytes`` / ``shard_samples``.

    Example::

        with ShardWriter(Store("s3://bucket/ds"), shard_bytes=512 * 10**6) as w:
            for s in samples:
                w.write(s)
        w.shards, w.rows   # manifest rows for shards.parquet and samples-*.parquet

    With ``on_shard``, each finished shard's record and rows go to ``on_shard(record, rows)``
    (which may queue work after the shard's upload with :meth:`submit`) instead of into
    ``rows``, so a long stream of samples keeps no rows here; with ``on_rows`` too, a shard's
    rows go to ``on_rows`` in pieces while it is written and ``on_shard`` gets the last ones
    (see :class:`TarShard`).

    Args:
        store: the destination.
        shard_bytes: the target shard size; a shard of two or more samples never exceeds it.
        shard_samples: also close a shard at this many samples.
        first_shard: the first shard's number.
        name_for: a shard's path from its number.
        on_shard: takes each finished shard's record and rows.
        on_rows: takes a shard's rows in pieces as it is written (needs ``on_shard``).

    Raises:
        ValueError: ``on_rows`` without ``on_shard``.
    """

    def __init__(self, store: Store, *, shard_bytes: int, shard_samples: int | None = None,
                 first_shard: int = 0, name_for: Callable[[int], str] = shard_name,
                 on_shard: Callable[[ShardRecord, SampleRows], None] | None = None,
                 on_rows: Callable[[SampleRows], None] | None = None) -> None:
        self.store = store
        self.shard_bytes = shard_bytes
        self.shard_samples = shard_samples
        self.name_for = name_for
        if on_rows is not None and on_shard is None:
            raise ValueError("ShardWriter: on_rows needs on_shard (which gets each shard's last rows)")
        self.on_shard = on_shard
        self.on_rows = on_rows
        self._next = first_shard
        self._current: TarShard | None = None
        # One uploader for all shards: a shard's last part uploads while the next fills.
        self._uploader: Uploader | None = None
        self.shards: list[ShardRecord] = []
        self.rows = SampleRows()

    def write(self, sample: PackSample) -> None:
        """Add a sample to the current shard, closing it first if the sample would overflow it.

        Args:
            sample: the sample.

        Raises:
            SourceError: a bad sample (see :meth:`TarShard.add`).
            StorageError: an upload failed.
        """
        cur = self._current
        if cur is not None and cur.num_samples > 0:
            # Count what the sample really adds (headers, padding) and the end-of-archive
            # blocks, so a shard of two or more samples never grows past shard_bytes.
            full_bytes = cur.bytes_written + tar_size(sample) + len(END_OF_ARCHIVE) > self.shard_bytes
            full_count = self.shard_samples is not None and cur.num_samples >= self.shard_samples
            if full_bytes or full_count:
                self._finish()
        if self._current is None:
            if self._uploader is None:
                self._uploader = Uploader()
            self._current = TarShard(self.store, self._next, self.name_for(self._next), self._uploader,
                                     on_rows=self.on_rows)
            self._next += 1
        self._current.add(sample)

    def _finish(self) -> None:
        if self._current is not None:
            shard, self._current = self._current, None
            record = shard.close()
            self.shards.append(record)
            if self.on_shard is not None:
                self.on_shard(record, shard.rows)
            else:
                self.rows.extend(shard.rows)

    def submit(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on an upload thread once every part queued so far is written (and
        before anything queued after it).

        Args:
            fn: the job; skipped if an earlier upload failed. :meth:`close` waits for it and
                raises its error.
        """
        if self._uploader is None:
            self._uploader = Uploader()
        self._uploader.submit(fn)

    def close(self) -> None:
        """Finish the last shard and wait until every shard is stored.

        Raises:
            StorageError: an upload (or a submitted job) failed.
        """
        try:
            self._finish()
        except BaseException:
            self.abort()
            raise
        uploader, self._uploader = self._uploader, None
        if uploader is not None:
            uploader.close()

    def abort(self) -> None:
        """Drop the shard being written and stop uploading (on an error path)."""
        if self._current is not None:
            self._current.abort()
            self._current = None
        uploader, self._uploader = self._uploader, None
        if uploader is not None:
            uploader.close(check=False)

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, exc_type: object, *_: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()
