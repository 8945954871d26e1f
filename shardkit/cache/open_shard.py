"""What every open shard of the cache gives its readers: the file descriptor and the hot bytes."""

from __future__ import annotations

from shardkit.cache.files import ShardRef
from shardkit.cache.landing import Landing

__all__ = ["OpenShard"]


class OpenShard:
    """The part of :class:`~shardkit.cache.cached_shard.CachedShard` and
    :class:`~shardkit.cache.landing_shard.LandingShard` that readers copy samples through.

    Args:
        ref: the shard.
        path: its file (the cache's, or the temp file a download fills).
        fd: that file, open for reading (the subclass closes it).
        landing: this process's landing buffer holding the shard's bytes, pinned for this
            reader (the subclass unpins it), or None.

    Attributes:
        ref: the shard.
        path: as given.
    """

    def __init__(self, ref: ShardRef, path: str, fd: int, landing: Landing | None) -> None:
        self.ref, self.path = ref, path
        self._fd = fd
        self._landing = landing

    @property
    def hot(self) -> memoryview | None:
        """The shard's bytes in this process's landing buffer, while it holds them (only the
        verified samples' bytes count for a landing shard): copy from them, never hand out
        views of them."""
        return self._landing.view() if self._landing is not None else None

    def fileno(self) -> int:
        """The open file (read-only), valid until the shard is closed: for ``os.preadv`` copies.

        Returns:
            Its file descriptor.

        Raises:
            ValueError: the shard is closed.
        """
        if self._fd < 0:
            raise ValueError(f"shard {self.ref.name} is closed")
        return self._fd
