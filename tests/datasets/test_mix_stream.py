"""StreamingDataset over a weighted mixture of three small datasets (tests/randomds.py): the exact
multiset per epoch, DataLoader workers, raw batches, resume with another world size and with
changed weights; and a real DDP run (gloo, 2 ranks x 2 workers, SeaweedFS, one cache)."""

from __future__ import annotations

import json
import os
import pickle
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import shardkit
from rank_procs import run_ranks as launch
from shardkit import Stream, StreamingDataLoader, StreamingDataset
from shardkit.batch.collate import unpack
from shardkit.errors import ConfigError
from shardkit.read.mixture import MixtureOrder, Share, mixture_counts
from randomds import pack_random

SIZES = (120, 60, 30)


@pytest.fixture(scope="module")
def three(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[str, dict[str, bytes]]]:
    out = []
    for i, n in enumerate(SIZES):
        out.append(pack_random(tmp_path_factory.mktemp(f"mix{i}"), n=n, max_body=400, classes=3, shard_bytes="6KB",
                               seed=10 + i, prefix=f"d{i}-"))
    return out


def expected(three: list[tuple[str, dict[str, bytes]]], shares: list[Share], epoch: int, seed: int,
             shuffle: bool = True, epoch_size: int | None = None) -> Counter[tuple[int, str]]:
    """The epoch's (stream, key) multiset from the pure mixture."""
    dss = [shardkit.open_dataset(url) for url, _ in three]
    counts = mixture_counts([ds.num_samples for ds in dss], shares, epoch_size)
    m = MixtureOrder([ds.shard_sizes() for ds in dss], counts, epoch=epoch, seed=seed, shuffle=shuffle)
    s, x = m.take(np.arange(len(m)))
    keys = [sorted(bodies) for _, bodies in three]  # pack keeps the source order: key i is sample i
    return Counter((int(a), keys[a][b]) for a, b in zip(s.tolist(), x.tolist()))


def pairs(items: Any) -> list[tuple[int, str]]:
    out = []
    for it in items:
        if isinstance(it["__key__"], list):
            out.extend(zip(it["__stream__"].tolist(), it["__key__"]))
        else:
            out.append((int(it["__stream__"]), it["__key__"]))
    return out


def test_one_epoch_is_the_exact_multiset_and_interleaved(three, tmp_path: Path) -> None:
    streams = [Stream(three[0][0], weight=0.5), Stream(three[1][0], weight=0.3), Stream(three[2][0], weight=0.2)]
    ds = StreamingDataset(streams, cache_dir=tmp_path / "cache", shuffle=True, seed=5)
    assert type(ds).__name__ == "MixedStreamingDataset" and ds.counts == (105, 63, 42)
    got = list(ds)
    assert Counter(pairs(got)) == expected(three, [s.share for s in streams], 0, 5)
    # Bodies are the packed ones, and streams interleave (no run of one stream is long).
    for s in got[:50]:
        assert s["bin"] == three[s["__stream__"]][1][s["__key__"]]
    labels = [s["__stream__"] for s in got]
    longest = max(len(r) for r in "".join(map(str, labels)).replace("0", " 0 ").split())
    assert longest <= 3
    ds.set_epoch(1)
    assert Counter(pairs(ds)) == expected(three, [s.share for s in streams], 1, 5)


def test_repeat_and_choose_with_workers_and_raw_batches(three, tmp_path: Path) -> None:
    streams = [Stream(three[0][0], choose=50), Stream(three[1][0], repeat=2.5), Stream(three[2][0])]
    ds = StreamingDataset(streams, cache_dir=tmp_path / "cache", shuffle=True, seed=1, batch_size=16)
    loader = StreamingDataLoader(ds, num_workers=2)
    batches = list(loader)
    got = pairs(batches)
    assert Counter(got) == expected(three, [s.share for s in streams], 0, 1)
    per = Counter(k for k in got)
    assert {per[(1, k)] for k in three[1][1]} == {2, 3}  # repeat 2.5: each sample 2 or 3 times
    b = batches[0]
    assert [bytes(v) for v in unpack(b, "bin")] == [three[s][1][k] for s, k in zip(b["__stream__"].tolist(), b["__key__"])]


def test_persistent_workers_follow_set_epoch_and_a_changed_mixture(three, tmp_path: Path) -> None:
    streams = [Stream(u, weight=w) for (u, _), w in zip(three, (1, 2, 3))]
    ds = StreamingDataset(streams, cache_dir=tmp_path / "cache", shuffle=True, seed=4, batch_size=10)
    loader = StreamingDataLoader(ds, num_workers=2, persistent_workers=True)
    first = pairs(loader)
    ds.set_epoch(1)  # the workers already run: they learn the epoch from the control file
    second = pairs(loader)
    assert Counter(second) == expected(three, [s.share for s in streams], 1, 4) != Counter(first)
    state = ds.state_dict(consumed=50)
    changed = StreamingDataset([Stream(u, weight=w) for (u, _), w in zip(three, (3, 2, 1))],
                               cache_dir=tmp_path / "cache", shuffle=True, seed=4, batch_size=10)
    clone = pickle.loads(pickle.dumps(changed))  # as a spawned worker gets it
    clone.load_state_dict(state)
    rest = pairs(clone)
    assert len(rest) == sum(clone.counts) == 160 and len(set(rest)) == 160
    assert set(rest).isdisjoint(second[:50])  # the loader's order is the rank's: its first 50 were seen


def test_without_a_cache_and_with_a_world_of_three(three) -> None:
    streams = [Stream(three[0][0], weight=1), Stream(three[1][0], weight=1), Stream(three[2][0], weight=1)]
    union: Counter[tuple[int, str]] = Counter()
    lengths = set()
    for rank in range(3):
        ds = StreamingDataset(streams, shuffle=True, seed=2, rank=rank, world_size=3, drop_last=True)
        got = pairs(ds)
        lengths.add(len(got))
        union.update(got)
    assert lengths == {70} and union == expected(three, [s.share for s in streams], 0, 2)


@pytest.mark.parametrize("new_weights", [None, (0.1, 0.1, 0.8)])
def test_stop_at_step_n_resume_with_another_world_and_weights(three, tmp_path: Path, new_weights) -> None:
    urls = [u for u, _ in three]
    old = [Stream(u, weight=w) for u, w in zip(urls, (0.6, 0.3, 0.1))]
    cache = tmp_path / "cache"
    seen: list[tuple[int, str]] = []
    state = None
    for rank in range(2):  # 2 ranks x 2 workers, batches of 5; stop after 7 steps
        ds = StreamingDataset(old, cache_dir=cache, shuffle=True, seed=3, rank=rank, world_size=2, batch_size=5)
        loader = StreamingDataLoader(ds, num_workers=2)
        for step, b in enumerate(loader):
            seen.extend(pairs([b]))
            if step == 6:
                state = json.loads(json.dumps(loader.state_dict()))
                break
    assert state is not None and len(seen) == 70
    new = old if new_weights is None else [Stream(u, weight=w) for u, w in zip(urls, new_weights)]
    rest: list[tuple[int, str]] = []
    lengths = set()
    for rank in range(3):
        ds = StreamingDataset(new, cache_dir=cache, shuffle=True, seed=3, rank=rank, world_size=3, drop_last=True)
        ds.load_state_dict(state)
        got = pairs(StreamingDataLoader(ds, num_workers=2, batch_size=4))
        lengths.add(len(got))
        rest.extend(got)
    assert len(lengths) == 1  # equal counts per rank
    full = expected(three, [s.share for s in old], 0, 3)
    if new_weights is None:  # the same mixture: nothing lost or repeated (the tail dropped by 3 ranks aside)
        missing = full - Counter(seen) - Counter(rest)
        assert not (Counter(seen) + Counter(rest) - full) and sum(missing.values()) < 3
    else:  # other weights: nothing seen comes back, and the rest leans to stream 2 as asked
        assert not set(seen) & set(rest) and len(set(rest)) == len(rest)
        per = Counter(s for s, _ in rest)
        assert per[2] == 30 - sum(1 for s, _ in seen if s == 2)  # stream 2 gives all it has left


def test_states_and_options_are_checked_in_one_line(three, tmp_path: Path) -> None:
    urls = [u for u, _ in three]
    mix = StreamingDataset([Stream(u) for u in urls], cache_dir=tmp_path / "c")
    single = StreamingDataset(urls[0], cache_dir=tmp_path / "c")
    with pytest.raises(ConfigError, match="saved on one dataset, not on a mixture"):
        mix.load_state_dict(single.state_dict())
    other = StreamingDataset([Stream(u) for u in urls[::-1]], cache_dir=tmp_path / "c")
    with pytest.raises(ConfigError, match="stream 0 was saved on"):
        other.load_state_dict(mix.state_dict())
    with pytest.raises(ConfigError, match="names no data"):
        single.load_state_dict(mix.state_dict())
    tampered = mix.state_dict()
    tampered["mixture"]["history"] = [{"counts": [200, 0, 0], "remaining": []}]  # stream 0 seen in full
    with pytest.raises(ConfigError, match="state_dict: its mixture does not fit these streams"):
        mix.load_state_dict(tampered)
    tampered["mixture"]["counts"] = [2**33, 0, 0]
    with pytest.raises(ConfigError, match="state_dict: mixture counts must be"):
        mix.load_state_dict(tampered)
    raw = StreamingDataset([Stream(u) for u in urls], cache_dir=tmp_path / "c", batch_size=4)
    assert StreamingDataLoader(raw, num_workers=1, multiprocessing_context="fork")._ring_blocker(raw).startswith(
        "a mixture of streams")
    with pytest.raises(ConfigError, match="zero_copy=True: not supported for a mixture"):
        StreamingDataset([Stream(u) for u in urls], cache_dir=tmp_path / "c", batch_size=4, zero_copy=True)
    with pytest.raises(ConfigError, match="wds_shards: takes one dataset URL"):
        shardkit.wds_shards([Stream(urls[0])], cache_dir=tmp_path / "c")
    with pytest.raises(ConfigError, match="every stream a weight, or none"):
        StreamingDataset([Stream(urls[0], weight=1), Stream(urls[1])])


WORKER = Path(__file__).resolve().parents[1] / "ddp_mix_worker.py"
REPO = Path(__file__).resolve().parents[2]


def run_ranks(tmp: Path, world: int, timeout: float = 120, **cfg: Any) -> list[dict[str, Any]]:
    tag = uuid.uuid4().hex[:8]
    return launch(WORKER, [{**cfg, "out": str(tmp / f"mix-{world}-{rank}-{tag}.json")} for rank in range(world)],
                  timeout=timeout)


@pytest.mark.slow
def test_ddp_two_ranks_two_workers_over_three_streams_one_by_query_stop_and_resume_with_three_ranks(s3_env: Any, s3_bucket: str,
                                                                     tmp_path: Path) -> None:
    urls, bodies = [], []
    for i, n in enumerate(SIZES):
        rng = np.random.default_rng(20 + i)
        data = [{"__key__": f"m{i}-{k:04d}", "bin": rng.bytes(int(rng.integers(50, 900)))} for k in range(n)]
        urls.append(f"{s3_bucket}/mix{i}")
        shardkit.pack(iter(data), urls[-1], shard_bytes="8KB", progress=False)
        bodies.append({d["__key__"]: d["bin"] for d in data})
    weights = [0.5, 0.3, 0.2]
    # Stream 0 is a subset by query: its first 80 keys of 120 (a where= on the manifest).
    picked = 80
    wheres = [f"key < 'm0-{picked:04d}'", None, None]
    # 212 samples: 2 ranks x 5 steps x 8 consume 80, and the 132 left split evenly over 3 ranks.
    cfg = {"urls": urls, "weights": weights, "wheres": wheres, "epoch_size": 212,
           "cache_dir": str(tmp_path / "cache"), "batch_size": 8, "num_workers": 2}
    first = run_ranks(tmp_path, 2, stop_after=5, **cfg)
    assert [r["steps"] for r in first] == [5, 5]
    state = tmp_path / "state.json"
    state.write_text(json.dumps(first[0]["state"]))
    second = run_ranks(tmp_path, 3, state_in=str(state), **cfg)
    assert len({len(r["pairs"]) for r in second}) == 1 and sum(len(r["pairs"]) for r in second) == 132
    got = Counter((s, k) for r in first + second for s, k in r["pairs"])
    dss = [shardkit.open_dataset(u) for u in urls]
    sizes = [d.shard_sizes() for d in dss]
    # The selection is a prefix of stream 0's samples (packed in key order): per shard, the
    # samples of that prefix; the mixture's positions in it are positions among its keys.
    sizes[0] = np.diff(np.minimum(np.concatenate(([0], np.cumsum(sizes[0]))), picked))
    counts = mixture_counts([picked, *(d.num_samples for d in dss[1:])], [Share(weight=w) for w in weights], 212)
    m = MixtureOrder(sizes, counts, epoch=0, seed=11)
    s, x = m.take(np.arange(len(m)))
    keys = [sorted(b) for b in bodies]
    keys[0] = keys[0][:picked]
    assert got == Counter((a, keys[a][b]) for a, b in zip(s.tolist(), x.tolist()))  # nothing lost or repeated
    # One node cache for the three datasets: a namespace each, every shard fetched by the node once.
    assert len([d for d in os.listdir(tmp_path / "cache") if not d.startswith(".")]) == 3
    assert sum(r["stats"]["misses"] + r["stats"]["prefetched"] for r in first) <= sum(d.num_shards for d in dss)


def test_a_stream_may_be_a_subset_by_where_or_indices_and_resumes_exactly(three, tmp_path: Path) -> None:
    keys0 = sorted(three[0][1])
    cut = keys0[len(keys0) // 3]
    chosen = [k for k in keys0 if k < cut]
    assert 0 < len(chosen) < len(keys0)
    keys1 = sorted(three[1][1])
    picks = list(range(0, 60, 3))

    def streams(where: str = f"key < '{cut}'") -> list[Stream]:
        return [Stream(three[0][0], where=where), Stream(three[1][0], indices=picks)]

    want = Counter([(0, k) for k in chosen] + [(1, keys1[i]) for i in picks])
    ds = StreamingDataset(streams(), cache_dir=tmp_path / "cache", shuffle=True, seed=3)
    assert ds.counts == (len(chosen), len(picks))  # no weights: each stream once per epoch
    got = list(ds)
    assert Counter(pairs(got)) == want
    assert all(s["bin"] == three[s["__stream__"]][1][s["__key__"]] for s in got)
    # Stop after 10 samples, resume in a new stream: the rest, nothing repeated.
    it = iter(ds)
    first = [next(it) for _ in range(10)]
    state = ds.state_dict()
    it.close()
    again = StreamingDataset(streams(), cache_dir=tmp_path / "cache", shuffle=True, seed=3)
    again.load_state_dict(json.loads(json.dumps(state)))
    assert Counter(pairs(first)) + Counter(pairs(again)) == want
    other = StreamingDataset(streams(f"key <= '{cut}'"), cache_dir=tmp_path / "cache", shuffle=True, seed=3)
    with pytest.raises(ConfigError, match="stream 0 .* another selection"):
        other.load_state_dict(state)
