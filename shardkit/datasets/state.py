"""The resume state of a StreamingDataset: making it, checking it, and the position it resumes at.

A state is a small JSON-able dict saved with a checkpoint. It names the data (fingerprint,
URL, creation time), the stream's order options and the epoch's remaining sample ranges with
the samples each rank had consumed, so a stopped epoch continues exactly, with any world size
or worker count.
"""

from __future__ import annotations

from typing import Any

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
               world_size: int, remaining: list[Range], consumed: int) -> dict[str, Any]:
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

    Returns:
        The state dict (JSON-able).
    """
    return {
        "version": STATE_VERSION, "dataset": ds.url, "created": ds.info.get("created"),
        "fingerprint": ds.fingerprint,
        "num_samples": ds.num_samples, "epoch": epoch, "seed": seed, "shuffle": shuffle,
        "shuffle_block": shuffle_block, "drop_last": drop_last, "world_size": world_size,
        "remaining": [list(r) for r in remaining],
        "consumed_per_rank": int(consumed),
    }


def check_state(state: Any, ds: Dataset, *, seed: int, shuffle: bool, shuffle_block: int) -> None:
    """Refuse a state that this stream cannot resume.

    Args:
        state: what the caller passed to ``load_state_dict``.
        ds: the dataset this stream reads.
        seed: this stream's shuffle seed.
        shuffle: whether this stream shuffles.
        shuffle_block: this stream's shards per shuffle block.

    Raises:
        ConfigError: ``state`` is not a dict, has another version, lacks keys, was saved on
            other data, or its sample count or order options differ from this stream's.
    """
    if not isinstance(state, dict):
        raise ConfigError(f"state_dict: expected a dict, got {type(state).__name__}")
    if state.get("version") != STATE_VERSION:
        raise ConfigError(f"state_dict: unsupported version {state.get('version')!r}")
    missing = [k for k in STATE_KEYS if k not in state]
    if missing:
        raise ConfigError(f"state_dict: missing {', '.join(map(repr, missing))} (a truncated checkpoint, "
                          "or not one from StreamingDataset.state_dict)")
    _check_same_data(state, ds)
    mine = {"num_samples": ds.num_samples, "seed": seed, "shuffle": shuffle, "shuffle_block": shuffle_block}
    for name, value in mine.items():
        if state[name] != value:
            raise ConfigError(f"state_dict: {name}={state[name]!r} does not match this dataset/stream ({value!r})")


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
    states had one is compared by its dataset's ``created`` time."""
    if "fingerprint" in state:
        same = state["fingerprint"] == ds.fingerprint
    else:
        same = state.get("created") in (None, ds.info.get("created"))
    if same:
        return
    saved_on = state.get("dataset")
    which = (f"another pack of {ds.url}: its shards differ" if saved_on in (None, ds.url)
             else f"saved on {saved_on}, another dataset than {ds.url}")
    raise ConfigError(f"state_dict: the checkpoint is from {which}; resume on the data it was saved on, "
                      "or start this epoch afresh without load_state_dict")
