"""The resume state of a mixture of streams: making it, checking it, and where it resumes.

Beside what a one-dataset state holds (:mod:`shardkit.datasets.state`: epoch, order options,
remaining M ranges, consumed per rank), a mixture's state records the mixture it ran: each
stream's identity (URL, fingerprint, samples), the options it ran with, the per-stream counts of
the epoch's current mixture and the earlier mixtures of the epoch (a run resumed under other
weights). Loaded with the same options it continues exactly; with other options it continues
the epoch over the samples not yet seen (see :mod:`shardkit.read.mixture`).
"""

from __future__ import annotations

from typing import Any, Sequence

from shardkit.errors import ConfigError
from shardkit.read.dataset import Dataset
from shardkit.read.mixture import Share, Stage
from shardkit.read.partition import Range
from shardkit.datasets.state import STATE_VERSION, _check_remaining, _is_int

__all__ = ["MAX_STAGES", "check_mix_state", "make_mix_state", "options_of"]

MAX_STAGES = 64  # mixtures one epoch may have gone through (a bound on what a state makes us compute)
_MAX_TOTAL = 2**32  # samples per mixture epoch a state may claim (bounds what loading it computes)


def options_of(shares: Sequence[Share], epoch_size: int | None) -> dict[str, Any]:
    """The mixture options as a state records them.

    Args:
        shares: per-stream options.
        epoch_size: the ``epoch_size`` option.

    Returns:
        A JSON-able dict.
    """
    return {"shares": [[s.weight, s.repeat, s.choose] for s in shares], "epoch_size": epoch_size}


def make_mix_state(dss: Sequence[Dataset], options: dict[str, Any], *, counts: Sequence[int],
                   history: Sequence[Stage], epoch: int, seed: int, shuffle: bool, shuffle_block: int,
                   drop_last: bool, world_size: int, remaining: list[Range], consumed: int,
                   selections: Sequence[str | None] = ()) -> dict[str, Any]:
    """The resumable position of a mixture.

    Args:
        dss: the streams' datasets.
        options: :func:`options_of` of the stream.
        counts: per-stream counts of the epoch's current mixture.
        history: the epoch's earlier mixtures.
        epoch: the epoch in progress.
        seed: the seed.
        shuffle: whether streams shuffle.
        shuffle_block: shards per shuffle block.
        drop_last: whether ranks drop the tail.
        world_size: ranks reading the epoch.
        remaining: the current mixture's M ranges not consumed before it (re)started.
        consumed: samples each rank has consumed of ``remaining``.
        selections: per stream, the digest of its ``where``/``indices`` selection (None: all of it).

    Returns:
        The state dict (JSON-able).
    """
    chosen = list(selections) or [None] * len(dss)
    return {
        "version": STATE_VERSION, "num_samples": int(sum(counts)), "epoch": epoch, "seed": seed,
        "shuffle": shuffle, "shuffle_block": shuffle_block, "drop_last": drop_last, "world_size": world_size,
        "remaining": [list(r) for r in remaining], "consumed_per_rank": int(consumed),
        "mixture": {
            "streams": [{"dataset": ds.url, "fingerprint": ds.fingerprint, "num_samples": ds.num_samples,
                         **({"selection": sel} if sel is not None else {})} for ds, sel in zip(dss, chosen)],
            "options": options, "counts": [int(c) for c in counts],
            "history": [{"counts": list(st.counts), "remaining": [list(r) for r in st.remaining]}
                        for st in history],
        },
    }


def _counts(value: Any, streams: int, what: str) -> tuple[int, ...]:
    if (not isinstance(value, list) or len(value) != streams or not all(_is_int(c) and c >= 0 for c in value)
            or sum(value) > _MAX_TOTAL):
        raise ConfigError(f"state_dict: {what} must be {streams} non-negative integers summing to at most "
                          f"{_MAX_TOTAL}, got {value!r:.80}")
    return tuple(int(c) for c in value)


def check_mix_state(state: Any, dss: Sequence[Dataset], *, seed: int, shuffle: bool, shuffle_block: int,
                    selections: Sequence[str | None] = ()) -> tuple[tuple[int, ...], tuple[Stage, ...], dict[str, Any]]:
    """Refuse a state this mixture cannot resume, in one line; return what it ran.

    Args:
        state: what the caller passed to ``load_state_dict``.
        dss: this stream's datasets, in order.
        seed: this stream's seed.
        shuffle: whether this stream shuffles.
        shuffle_block: this stream's shards per shuffle block.
        selections: per stream, the digest of its selection (None: all of it).

    Returns:
        (the current mixture's counts, its earlier stages, the options it ran with).

    Raises:
        ConfigError: not a dict, another version, not a mixture's state, other streams (by
            fingerprint, in order), other order options, or a malformed field.
    """
    if not isinstance(state, dict):
        raise ConfigError(f"state_dict: expected a dict, got {type(state).__name__}")
    if state.get("version") != STATE_VERSION:
        raise ConfigError(f"state_dict: unsupported version {state.get('version')!r} (this shardkit writes "
                          f"{STATE_VERSION})")
    mix = state.get("mixture")
    if not isinstance(mix, dict):
        raise ConfigError(f"state_dict: saved on one dataset, not on a mixture of streams; this stream mixes "
                          f"{len(dss)}: start this epoch afresh without load_state_dict")
    streams = mix.get("streams")
    if not isinstance(streams, list) or len(streams) != len(dss):
        raise ConfigError(f"state_dict: saved on a mixture of {len(streams) if isinstance(streams, list) else '?'} "
                          f"streams, this one has {len(dss)}; resume with the streams it was saved with")
    for i, (saved, ds) in enumerate(zip(streams, dss)):
        if not isinstance(saved, dict) or saved.get("fingerprint") != ds.fingerprint:
            where = saved.get("dataset") if isinstance(saved, dict) else None
            raise ConfigError(f"state_dict: stream {i} was saved on {where!r}, other data than {ds.url}; resume "
                              "with the streams in the order they were saved")
        want = list(selections)[i] if selections else None
        if saved.get("selection") != want:
            raise ConfigError(f"state_dict: stream {i} ({ds.url}) was saved with another selection (where=/indices=) "
                              "than this one's; resume with the selection it was saved with")
    for name, value in (("seed", seed), ("shuffle", shuffle), ("shuffle_block", shuffle_block)):
        if state.get(name) != value:
            raise ConfigError(f"state_dict: {name}={state.get(name)!r} does not match this stream ({value!r})")
    for name in ("epoch", "world_size", "consumed_per_rank"):
        if not _is_int(state.get(name)) or state[name] < (1 if name == "world_size" else 0):
            raise ConfigError(f"state_dict: {name} must be a non-negative integer, got {state.get(name)!r}")
    if state["epoch"] > 2**32 - 1:
        raise ConfigError(f"state_dict: epoch={state['epoch']} is out of range")
    if not isinstance(state.get("drop_last"), bool):
        raise ConfigError(f"state_dict: drop_last must be True or False, got {state.get('drop_last')!r}")
    counts = _counts(mix.get("counts"), len(dss), "mixture counts")
    history = mix.get("history")
    if not isinstance(history, list) or len(history) > MAX_STAGES:
        raise ConfigError(f"state_dict: mixture history must be a list of at most {MAX_STAGES} stages")
    stages = []
    for h in history:
        if not isinstance(h, dict):
            raise ConfigError("state_dict: a mixture history stage must be a dict")
        c = _counts(h.get("counts"), len(dss), "a history stage's counts")
        _check_remaining(h.get("remaining"), sum(c), "the mixture")
        stages.append(Stage(c, tuple((int(a), int(b)) for a, b in h["remaining"])))
    total = _check_remaining(state.get("remaining"), sum(counts), "the mixture")
    ranks = int(state["world_size"])
    share = total // ranks if state["drop_last"] else -(-total // ranks)
    if int(state["consumed_per_rank"]) > share:
        raise ConfigError(f"state_dict: consumed_per_rank={state['consumed_per_rank']} exceeds the {share} "
                          f"samples each of {ranks} ranks had of the {total} remaining")
    options = mix.get("options")
    if not isinstance(options, dict):
        raise ConfigError("state_dict: mixture options must be a dict")
    return counts, tuple(stages), options
