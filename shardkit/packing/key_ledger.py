"""Finding repeated sample keys among tens of millions without holding the keys.

A dict of key strings costs over a hundred bytes a key: gigabytes at tens of millions of
samples, in the process that indexes existing WebDataset tars. The ledger keeps 12 bytes a key
instead (its xxh3-64 and its shard), and names the pairs of shards whose keys hash alike once
everything is seen; the caller reads those two shards' keys back to tell a real repeat from a
hash collision.
"""

from __future__ import annotations

from array import array

import numpy as np
import xxhash

__all__ = ["KeyLedger", "key_hash"]


def key_hash(key: str) -> int:
    """The xxh3-64 of a sample key (undecodable bytes surrogate-escaped, as names are read).

    Args:
        key: the key.

    Returns:
        The 64-bit hash.
    """
    return xxhash.xxh3_64_intdigest(key.encode("utf-8", "surrogateescape"))


class KeyLedger:
    """Keys as they are seen (:meth:`add`), then :meth:`suspects`."""

    def __init__(self) -> None:
        self._hashes = array("Q")
        self._shards = array("I")

    def __len__(self) -> int:
        return len(self._hashes)

    def add(self, key: str, shard: int) -> None:
        """Note ``key``, seen in ``shard``.

        Args:
            key: a sample key.
            shard: the shard holding it.
        """
        self._hashes.append(key_hash(key))
        self._shards.append(shard)

    def suspects(self) -> list[tuple[int, int]]:
        """(shard, shard) pairs, lowest first, that may hold one key twice (the same shard
        twice for a key repeated inside it), in shard order: every pair of entries whose keys
        hash alike.

        Returns:
            The pairs; the caller reads those shards' keys back to find real repeats.
        """
        if len(self) < 2:
            return []
        hashes = np.frombuffer(self._hashes, dtype=np.uint64)
        shards = np.frombuffer(self._shards, dtype=np.uint32)
        order = np.argsort(hashes, kind="stable")
        ordered = hashes[order]
        starts = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1]])
        ends = np.r_[starts[1:], len(ordered)]
        pairs: set[tuple[int, int]] = set()
        for lo, hi in zip(starts[ends - starts > 1], ends[ends - starts > 1]):  # runs of equal hashes
            group = sorted(int(x) for x in shards[order[lo:hi]])
            pairs.update((a, b) for i, a in enumerate(group) for b in group[i + 1:])
        return sorted(pairs)
