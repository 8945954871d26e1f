"""The resume state of a StreamingDataset: making it, checking it, and the position it resumes at.

A state is a small JSON-able dict saved with a checkpoint. It names the data (fingerprint,
URL, creation time), the stream's order options and the epoch's remaining sample ranges with
the samples each rank had consumed, so a stopped epoch continues exactly, with any world size
or worker count.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from shardkit.errors import ConfigError
from shardkit.read.dataset import Dataset
from shardkit.read.partition import Range, consumed_remaining

__all__ = ["STATE_KEYS", "STATE_VERSION", "check_state", "make_state", "resume_point"]

STATE_VERSION = 1
#: What loading a state needs; "dataset", "created" and "fingerprint" name the data (optional:
#: states from before the fingerprint lack it).
STATE_KEYS = ("num_samples", "epoch", "seed", "shuffle", "shuffle_block", "drop_last", "world_size",
              "remaining", "consumed_per_rank")


def make_state(ds: Dataset, *, epoch: int, seed: int, shuffle: bool, shuffle_block: int, drop_last: bool,
               world_size: int, remaining: list[Range], consumed: int, selection: str | None = None,
               num_samples: int | None = None) -> dict[str, Any]:
    """The resumable position of a stream over ``ds``.

    Args:
        ds: the dataset streamed.
        epoch: the epoch in progress.
        seed: the stream's shuffle seed.
        shuffle: whether the stream shuffles.
        shuffle_block: shards per shuffle block.
        drop_last: whether ranks drop the tail rather than pad.
        world_size: ranks reading the epoch.
        remaining: the epoch's sample ranges not consumed before it (re)started.
        consumed: samples each rank has consumed of ``remaining``.
        selection: the digest of the stream's ``where``/``indices`` selection, if any.
        num_samples: the samples an epoch holds (the selected count; default: the dataset's).

    Returns:
        The state dict (JSON-able); with a selection, it has ``"selection"`` too.
    """
    extra = {} if selection is None else {"selection": selection}
    return extra | {
        "version": STATE_VERSION, "dataset": ds.url, "created": ds.info.get("created"),
        "fingerprint": ds.fingerprint, "dataset_version": ds.version,
        "num_samples": ds.num_samples if num_samples is None else num_samples, "epoch": epoch, "seed": seed, "shuffle": shuffle,
        "shuffle_block": shuffle_block, "drop_last": drop_last, "world_size": world_size,
        "remaining": [list(r) for r in remaining],
        "consumed_per_rank": int(consumed),
    }


def check_state(state: Any, ds: Dataset, *, seed: int, shuffle: bool, shuffle_block: int,
                selection: str | None = None, num_samples: int | None = None) -> None:
    """Refuse a state that this stream cannot resume: every field is checked, by type and
    against the dataset, before anything is sized from it (a ``remaining`` range of 10**9
    samples would otherwise be allocated, and ``len(stream)`` report it).

    Args:
        state: what the caller passed to ``load_state_dict``.
        ds: the dataset this stream reads.
        seed: this stream's shuffle seed.
        shuffle: whether this stream shuffles.
        shuffle_block: this stream's shards per shuffle block.
        selection: the digest of this stream's selection (None: the whole dataset).
        num_samples: the samples an epoch of this stream holds (default: the dataset's).

    Raises:
        ConfigError: in one line: ``state`` is not a dict, has another version, lacks keys,
            names no data or other data, holds a field of the wrong type or out of range (its
            remaining ranges must lie in the dataset's samples, ascending, and its consumed
            count within a rank's share), or its order options differ from this stream's.
    """
    if not isinstance(state, dict):
        raise ConfigError(f"state_dict: expected a dict, got {type(state).__name__}")
    version = state.get("version")
    if not _is_int(version) or version != STATE_VERSION:
        raise ConfigError(f"state_dict: unsupported version {version!r} (this shardkit writes {STATE_VERSION})")
    missing = [k for k in STATE_KEYS if k not in state]
    if missing:
        raise ConfigError(f"state_dict: missing {', '.join(map(repr, missing))} (a truncated checkpoint, "
                          "or not one from StreamingDataset.state_dict)")
    _check_same_data(state, ds)
    if state.get("selection") != selection:
        saved, ours = state.get("selection"), selection
        raise ConfigError("state_dict: saved on " + (f"a selection ({saved})" if saved else "the whole dataset")
                          + ", this stream reads " + (f"another selection ({ours})" if ours else "the whole dataset")
                          + ": resume with the same where=/indices= it was saved with")
    n = ds.num_samples if num_samples is None else num_samples
    for name, kind in (("num_samples", int), ("epoch", int), ("seed", int), ("shuffle_block", int),
                       ("world_size", int), ("consumed_per_rank", int), ("shuffle", bool), ("drop_last", bool)):
        value = state[name]
        if not (_is_int(value) if kind is int else isinstance(value, bool)):
            raise ConfigError(f"state_dict: {name} must be {'an integer' if kind is int else 'True or False'}, "
                              f"got {value!r}")
    mine = {"num_samples": n, "seed": seed, "shuffle": shuffle, "shuffle_block": shuffle_block}
    for name, value in mine.items():
        if state[name] != value:
            raise ConfigError(f"state_dict: {name}={state[name]!r} does not match this dataset/stream ({value!r})")
    for name, lo, hi in (("epoch", 0, 2**32 - 1), ("world_size", 1, None), ("consumed_per_rank", 0, n)):
        value = int(state[name])
        if value < lo or (hi is not None and value > hi):
            raise ConfigError(f"state_dict: {name}={value} is out of range "
                              f"[{lo}, {'...' if hi is None else hi}] for the {n} samples of {ds.url}")
    total = _check_remaining(state["remaining"], n, ds.url)
    ranks = int(state["world_size"])
    share = total // ranks if state["drop_last"] else -(-total // ranks)
    if int(state["consumed_per_rank"]) > share:
        raise ConfigError(f"state_dict: consumed_per_rank={int(state['consumed_per_rank'])} exceeds the {share} "
                          f"samples each of {ranks} ranks had of the {total} remaining")


def _is_int(value: Any) -> bool:
    """An integer (numpy's too), not a bool."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _check_remaining(remaining: Any, num_samples: int, url: str) -> int:
    """Check a state's ``remaining``: (start, stop) integer pairs within ``[0, num_samples]``,
    ascending and disjoint; its length is checked before its entries are looked at.

    Returns:
        The samples it holds.
    """
    if not isinstance(remaining, (list, tuple)):
        raise ConfigError(f"state_dict: remaining must be a list of [start, stop] pairs, got {type(remaining).__name__}")
    if len(remaining) > num_samples + 1:  # disjoint non-empty ranges of num_samples samples, and maybe one empty
        raise ConfigError(f"state_dict: remaining holds {len(remaining)} ranges, more than the {num_samples} "
                          f"samples of {url} can make")
    total, last = 0, 0
    for pair in remaining:
        if (not isinstance(pair, (list, tuple)) or len(pair) != 2 or not all(_is_int(v) for v in pair)):
            raise ConfigError(f"state_dict: remaining must hold [start, stop] integer pairs, got {pair!r}")
        a, b = int(pair[0]), int(pair[1])
        if not 0 <= a <= b <= num_samples:
            raise ConfigError(f"state_dict: remaining range [{a}, {b}] lies outside the {num_samples} samples of "
                              f"{url} (a state saved on other data, or edited)")
        if a < b:
            if a < last:
                raise ConfigError(f"state_dict: remaining ranges must be ascending and disjoint, [{a}, {b}] "
                                  f"starts before {last}")
            total, last = total + b - a, b
    return total


def resume_point(state: dict[str, Any]) -> tuple[int, list[Range]]:
    """Where a checked state resumes: its epoch and the sample ranges no rank has consumed.

    Args:
        state: a state :func:`check_state` accepted.

    Returns:
        ``(epoch, remaining ranges)``.

    Raises:
        ConfigError: the consumed count does not fit the state's ranges and world size.
    """
    remaining = [(int(a), int(b)) for a, b in state["remaining"]]
    left = consumed_remaining(remaining, int(state["world_size"]), bool(state["drop_last"]),
                              int(state["consumed_per_rank"]))
    return int(state["epoch"]), left


def _check_same_data(state: dict[str, Any], ds: Dataset) -> None:
    """Refuse a state saved on other data: the same sample count in another shard layout
    would resume silently, repeating some samples and skipping others. The data's fingerprint
    decides, not the URL (a copy in another bucket is the same data); a state saved before
    states had one is compared by its dataset's ``created`` time. A state with
    neither names no data, and is refused."""
    fingerprint, created = state.get("fingerprint"), state.get("created")
    saved_version = state.get("dataset_version")  # states from before versions lack it
    if _is_int(saved_version) and saved_version != ds.version and state.get("dataset") in (None, ds.url):
        raise ConfigError(f"state_dict: saved on version {saved_version} of {ds.url}, but this stream opened version "
                          f"{ds.version}; open it with version={saved_version} to resume there, or start this "
                          "epoch afresh without load_state_dict")
    if fingerprint is not None:
        if not isinstance(fingerprint, str):
            raise ConfigError(f"state_dict: fingerprint must be a string, got {type(fingerprint).__name__}")
        same = fingerprint == ds.fingerprint
    elif isinstance(created, str):
        same = created == ds.info.get("created")
    else:
        raise ConfigError("state_dict: names no data (no 'fingerprint', no 'created'), so it cannot be checked "
                          f"against {ds.url}: not a state from StreamingDataset.state_dict")
    if same:
        return
    saved_on = state.get("dataset")
    which = (f"is from another pack of {ds.url}: its shards differ" if saved_on in (None, ds.url)
             else f"was saved on {saved_on}, another dataset than {ds.url}")
    raise ConfigError(f"state_dict: the checkpoint {which}; resume on the data it was saved on, "
                      "or start this epoch afresh without load_state_dict")
