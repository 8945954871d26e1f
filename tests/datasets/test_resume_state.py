"""Bad input to a stream: resume states are checked field by field against the dataset they
are loaded into, before anything is sized from them; sizes that are not finite are refused
naming the option."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from randomds import pack_random
from shardkit import ShardDataset, StreamingDataset, wds_shards
from shardkit.config import parse_size
from shardkit.errors import ConfigError

N = 30


@pytest.fixture(scope="module")
def ds_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    return pack_random(tmp_path_factory.mktemp("state"), n=N, max_body=500, classes=3, shard_bytes="4KB", seed=3,
                       prefix="s")[0]


@pytest.fixture(scope="module")
def other_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Other data with the same number of samples."""
    return pack_random(tmp_path_factory.mktemp("other"), n=N, max_body=500, classes=3, shard_bytes="4KB", seed=8,
                       prefix="s")[0]


def _saved(url: str) -> dict[str, Any]:
    sd = StreamingDataset(url, shuffle=True, seed=1)
    it = iter(sd)
    for _ in range(7):
        next(it)
    state = sd.state_dict()
    it.close()  # type: ignore[attr-defined]
    return state


def test_a_good_state_resumes_the_rest(ds_url: str) -> None:
    state = _saved(ds_url)
    sd = StreamingDataset(ds_url, shuffle=True, seed=1)
    sd.load_state_dict(state)
    assert len(sd) == N - 7 and len(list(sd)) == N - 7


@pytest.mark.parametrize(("change", "message"), [
    ({"remaining": [[0, 10**9]]}, r"remaining range \[0, 1000000000\] lies outside the 30 samples"),
    ({"remaining": [[-5, 3]]}, r"remaining range \[-5, 3\] lies outside"),
    ({"remaining": [[0, 10], [5, 20]]}, r"ascending and disjoint"),
    ({"remaining": [[0.0, 5.0]]}, r"remaining must hold \[start, stop\] integer pairs"),
    ({"remaining": [[0, True]]}, r"remaining must hold \[start, stop\] integer pairs"),
    ({"remaining": [[0, 1, 2]]}, r"remaining must hold \[start, stop\] integer pairs"),
    ({"remaining": "0-30"}, r"remaining must be a list"),
    ({"remaining": [[0, 1]] * (10**6)}, r"remaining holds 1000000 ranges, more than the 30 samples"),
    ({"consumed_per_rank": 10**9}, r"consumed_per_rank=1000000000 is out of range"),
    ({"consumed_per_rank": 29, "remaining": [[0, 10]]}, r"consumed_per_rank=29 exceeds the 10 samples"),
    ({"consumed_per_rank": -1}, r"consumed_per_rank=-1 is out of range"),
    ({"consumed_per_rank": "7"}, r"consumed_per_rank must be an integer"),
    ({"epoch": -1}, r"epoch=-1 is out of range"),
    ({"epoch": 2**40}, r"epoch=1099511627776 is out of range"),
    ({"epoch": 1.5}, r"epoch must be an integer"),
    ({"world_size": 0}, r"world_size=0 is out of range"),
    ({"world_size": None}, r"world_size must be an integer"),
    ({"drop_last": "no"}, r"drop_last must be True or False"),
    ({"shuffle": 1}, r"shuffle must be True or False"),
    ({"num_samples": 10**9}, r"num_samples=1000000000 does not match"),
    ({"version": True}, r"unsupported version"),
    ({"fingerprint": 123}, r"fingerprint must be a string"),
])
def test_a_bad_state_is_refused_in_one_line_before_anything_is_sized(ds_url: str, change: dict[str, Any],
                                                                     message: str) -> None:
    state = {**_saved(ds_url), **change}
    sd = StreamingDataset(ds_url, shuffle=True, seed=1)
    with pytest.raises(ConfigError, match=message) as info:
        sd.load_state_dict(state)
    assert "\n" not in str(info.value) and str(info.value).startswith("state_dict: ")
    assert len(sd) == N  # the stream stays as it was


def test_a_state_naming_no_data_is_refused(ds_url: str, other_url: str) -> None:
    state = _saved(ds_url)
    nothing = {k: v for k, v in state.items() if k not in ("fingerprint", "created")}
    for url in (other_url, ds_url):  # it cannot be told from other data: refused everywhere
        with pytest.raises(ConfigError, match=r"^state_dict: names no data \(no 'fingerprint', no 'created'\)"):
            StreamingDataset(url, shuffle=True, seed=1).load_state_dict(nothing)
    with pytest.raises(ConfigError, match="^state_dict: the checkpoint was saved on .*, another dataset than"):
        StreamingDataset(other_url, shuffle=True, seed=1).load_state_dict(state)
    # A state from before fingerprints, on its own data, still resumes (its created time matches).
    old = {k: v for k, v in state.items() if k != "fingerprint"}
    sd = StreamingDataset(ds_url, shuffle=True, seed=1)
    sd.load_state_dict(old)
    assert len(sd) == N - 7


def test_a_huge_world_size_sizes_nothing(ds_url: str) -> None:
    state = {**_saved(ds_url), "world_size": 10**12, "consumed_per_rank": 1}
    sd = StreamingDataset(ds_url, shuffle=True, seed=1)
    sd.load_state_dict(state)  # each of 10**12 ranks had at most one sample: rank 0..29 took theirs
    assert len(sd) == 0


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, "1" + "0" * 400 + "GB"])
def test_sizes_that_are_not_finite_are_a_config_error_naming_the_option(ds_url: str, tmp_path: Path,
                                                                        value: Any) -> None:
    with pytest.raises(ConfigError, match="^cache_limit: "):
        parse_size(value, "cache_limit")
    with pytest.raises(ConfigError, match="^cache_limit: "):
        StreamingDataset(ds_url, cache_dir=tmp_path, cache_limit=value)
    with pytest.raises(ConfigError, match="^cache_limit: "):
        ShardDataset(ds_url, cache_dir=tmp_path, cache_limit=value)
    with pytest.raises(ConfigError, match="^cache_limit: "):
        wds_shards(ds_url, cache_dir=tmp_path, cache_limit=value)
    with pytest.raises(ConfigError, match="^part_size: "):
        ShardDataset(ds_url, part_size=value)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"concurrency": 1.5}, "concurrency must be an integer"),
    ({"concurrency": 0}, "concurrency must be >= 1"),
    ({"max_open_shards": "4"}, "max_open_shards must be an integer"),
])
def test_shard_dataset_numbers_are_checked_by_name(ds_url: str, kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ShardDataset(ds_url, **kwargs)
