"""Finding repeated sample keys among tens of millions without holding the keys.

A set or dict of key strings costs over a hundred bytes a key (more for long keys):
gigabytes at tens of millions of samples. Two structures instead:

- :class:`KeyLedger`, for ``shardkit index``, which can check once everything is seen: 12
  bytes a key (its xxh3-64 and its shard); it names the pairs of shards whose keys hash alike,
  and the caller reads those two shards' keys back to tell a real repeat from a hash collision.
- :class:`KeySet`, for a pack of an iterable, which must tell a repeat the moment it comes (to
  refuse or skip that sample): an open-addressing table of each key's xxh3-128, 16 bytes a
  slot, at most 3/4 full and at least 3/8 after it grows (about 21 to 43 bytes a key, whatever
  the key's length). Two keys are taken as the same when their 128-bit hashes are: a false
  "repeat" needs a collision, of probability about n^2 / 2^129 (10^-19 at ten billion keys),
  treated as impossible.
"""

from __future__ import annotations

from array import array

import numpy as np
import xxhash

__all__ = ["KeyLedger", "KeySet", "key_hash"]


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


_MASK64 = (1 << 64) - 1


class KeySet:
    """The keys seen so far, as their xxh3-128 (see the module docstring): :meth:`add` says
    whether a key is new."""

    _START = 1 << 10  # slots at first

    def __init__(self) -> None:
        self._slots = array("Q", bytes(16 * self._START))  # (high, low) per slot; (0, 0) is empty
        self._mask = self._START - 1
        self._count = 0

    def __len__(self) -> int:
        return self._count

    @property
    def nbytes(self) -> int:
        """The bytes the table holds."""
        return self._slots.itemsize * len(self._slots)

    def add(self, key: str) -> bool:
        """Note ``key``.

        Args:
            key: a sample key.

        Returns:
            True if it was not seen before, False for a repeat.
        """
        digest = xxhash.xxh3_128_intdigest(key.encode("utf-8", "surrogateescape"))
        high, low = digest >> 64, (digest & _MASK64) or 1  # (x, 0) would read as an empty slot's low half
        if (self._count + 1) * 4 > (self._mask + 1) * 3:
            self._grow()
        if self._place(self._slots, self._mask, high, low):
            self._count += 1
            return True
        return False

    @staticmethod
    def _place(slots: array[int], mask: int, high: int, low: int) -> bool:
        """Put (high, low) in its slot (linear probing); False if it is there already."""
        i = high & mask
        while True:
            h, lo = slots[2 * i], slots[2 * i + 1]
            if lo == 0:  # empty (a stored low half is never 0)
                slots[2 * i], slots[2 * i + 1] = high, low
                return True
            if h == high and lo == low:
                return False
            i = (i + 1) & mask

    def _grow(self) -> None:
        size = 2 * (self._mask + 1)
        slots = array("Q", bytes(16 * size))
        old = self._slots
        for j in range(0, len(old), 2):
            if old[j + 1]:
                self._place(slots, size - 1, old[j], old[j + 1])
        self._slots, self._mask = slots, size - 1
