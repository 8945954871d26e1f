"""How many samples each stream of a mixture gives per epoch: the ``weight``/``repeat``/``choose``
options (:class:`Share`) turned into per-stream counts (:func:`mixture_counts`), and the counts
for the rest of an epoch resumed under other options (:func:`rest_counts`).

**What an epoch is.** Stream ``i`` (``n_i`` samples) contributes ``c_i`` samples per epoch and the
epoch is their sum, ``C = sum c_i``. :func:`mixture_counts` turns the options into counts, as
MosaicML Streaming's ``proportion``/``repeat``/``choose`` do (each stream sets at most one):

* ``weight`` (relative): either every stream has one or none does. The epoch has
  ``epoch_size`` samples (default ``sum n_i``) and stream ``i`` gets ``epoch_size * w_i / sum w``
  rounded by largest remainder, so each count is within one sample of its exact share and the
  counts add up to ``epoch_size``;
* ``repeat`` (absolute): ``round(repeat * n_i)`` samples: ``floor`` whole copies of the stream and
  a seeded subset for the fraction, so each sample appears ``floor(repeat)`` or
  ``ceil(repeat)`` times (``repeat`` below 1 subsamples);
* ``choose`` (absolute): exactly ``choose`` samples, built the same way (copies + a subset);
* none of them: ``repeat=1``. ``epoch_size`` with absolute streams scales their counts to it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

from shardkit.config import int_arg
from shardkit.errors import ConfigError

__all__ = ["Share", "allocate", "mixture_counts", "rest_counts"]


@dataclass(frozen=True)
class Share:
    """What one stream contributes per epoch: at most one of the three may be set.

    Args:
        weight: relative share of the epoch (every stream of a mixture has one, or none).
        repeat: upsample factor: ``round(repeat * n)`` samples per epoch.
        choose: absolute samples per epoch.
    """

    weight: float | None = None
    repeat: float | None = None
    choose: int | None = None

    def __post_init__(self) -> None:
        set_ = [k for k in ("weight", "repeat", "choose") if getattr(self, k) is not None]
        if len(set_) > 1:
            raise ConfigError(f"Stream: set at most one of weight, repeat, choose (got {', '.join(set_)})")
        for name in ("weight", "repeat"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))
                                  or not math.isfinite(v) or v < 0):
                raise ConfigError(f"Stream: {name} must be a finite number >= 0, got {v!r}")
        if self.choose is not None:
            int_arg("choose", self.choose, 0)


def allocate(total: int, weights: Sequence[float], caps: Sequence[int] | None = None) -> list[int]:
    """Split ``total`` by ``weights`` with the largest remainder method, capped per stream.

    Each share is within one of ``total * w_i / sum w`` (before caps); ties go to the lower
    index. A stream whose share exceeds its cap gets the cap, and the excess is split again
    over the others by weight, until nothing is over or nobody has room.

    Args:
        total: what to split (>= 0).
        weights: non-negative weights with a positive sum (exact rationals of the floats).
        caps: the most each stream can take (None: no caps).

    Returns:
        The counts (their sum is ``total``, or the sum of the caps if smaller).

    Raises:
        ConfigError: the weights are negative or sum to zero while ``total`` > 0.
    """
    w = [Fraction(x) for x in weights]
    if any(x < 0 for x in w):
        raise ConfigError("weights must be >= 0")
    out = [0] * len(w)
    open_ = [i for i in range(len(w)) if w[i] > 0 and (caps is None or caps[i] > 0)]
    left = total
    while left > 0 and open_:
        wsum = sum(w[i] for i in open_)
        quotas = {i: left * w[i] / wsum for i in open_}
        share = {i: math.floor(q) for i, q in quotas.items()}
        extra = left - sum(share.values())
        for i in sorted(open_, key=lambda i: (-(quotas[i] - share[i]), i))[:extra]:
            share[i] += 1
        over = [i for i in open_ if caps is not None and out[i] + share[i] > caps[i]]
        if not over:
            for i in open_:
                out[i] += share[i]
            return out
        assert caps is not None
        for i in over:  # full: fill to the cap, and split what is left again without it
            left -= caps[i] - out[i]
            out[i] = caps[i]
        open_ = [i for i in open_ if i not in over]
    if left > 0 and total > 0 and not any(x > 0 for x in w):
        raise ConfigError("weights must have a positive sum")
    return out


def mixture_counts(sizes: Sequence[int], shares: Sequence[Share], epoch_size: int | None = None) -> list[int]:
    """Samples each stream contributes per epoch (see the module docstring).

    Args:
        sizes: samples per stream (``n_i``).
        shares: each stream's option.
        epoch_size: samples per epoch (default: ``sum n_i`` with weights, the counts' sum else).

    Returns:
        The per-stream counts ``c_i``.

    Raises:
        ConfigError: some streams have a weight and others not, weights sum to zero, a
            stream with no samples is asked for some, or ``epoch_size`` is out of range.
    """
    if len(sizes) != len(shares) or not sizes:
        raise ConfigError("a mixture needs at least one stream, and one share per stream")
    weighted = [s.weight is not None for s in shares]
    if any(weighted) and not all(weighted):
        raise ConfigError("Stream: give every stream a weight, or none (use repeat=/choose= for absolute counts)")
    if epoch_size is not None:
        epoch_size = int_arg("epoch_size", epoch_size, 0)
    if all(weighted):
        ws = [float(s.weight) for s in shares]  # type: ignore[arg-type]
        if sum(ws) <= 0:
            raise ConfigError("Stream: the weights must have a positive sum")
        counts = allocate(sum(sizes) if epoch_size is None else epoch_size, ws)
    else:
        counts = [s.choose if s.choose is not None
                  else math.floor((1.0 if s.repeat is None else s.repeat) * n + 0.5)
                  for s, n in zip(shares, sizes)]
        if epoch_size is not None:
            if sum(counts) == 0 and epoch_size:
                raise ConfigError("epoch_size: the streams' counts are all 0, nothing to scale")
            counts = allocate(epoch_size, counts) if epoch_size else [0] * len(counts)
    for i, (c, n) in enumerate(zip(counts, sizes)):
        if c and not n:
            raise ConfigError(f"Stream {i} has no samples but is asked for {c} per epoch")
    return counts


def rest_counts(sizes: Sequence[int], shares: Sequence[Share], epoch_size: int | None,
                given: Sequence[int], unseen: Sequence[int]) -> list[int]:
    """Counts for the rest of an epoch resumed under a new mixture (see the module docstring).

    Args:
        sizes: samples per stream.
        shares: the new options.
        epoch_size: the new ``epoch_size`` option.
        given: samples each stream already gave this epoch.
        unseen: samples of each stream not yet seen this epoch.

    Returns:
        Per-stream counts for the rest of the epoch, each at most its unseen samples.

    Raises:
        ConfigError: as :func:`mixture_counts`.
    """
    full = mixture_counts(sizes, shares, epoch_size)
    if all(s.weight is not None for s in shares):
        left = max(sum(full) - sum(given), 0)
        return allocate(left, [float(s.weight) for s in shares], caps=unseen)  # type: ignore[arg-type]
    return [min(max(c - g, 0), u) for c, g, u in zip(full, given, unseen)]
