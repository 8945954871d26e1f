"""TokenStream: windows concatenated back equal the packed token arrays exactly (both modes, EOS,
targets); ranks x DataLoader workers disjoint, equal and complete; resume mid-epoch with another
world size and worker count; a weighted mixture of two token datasets; bad datasets and states."""

from __future__ import annotations

import json
import os
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import shardkit
from shardkit import Stream, StreamingDataLoader, TokenStream
from shardkit.errors import ConfigError
from shardkit.read.mixture import Share, mixture_counts
from randomds import pack_random
from rank_procs import run_ranks as launch

BASE_B = 1_000_000  # dataset B's token ids start here, so a window says which dataset it is from


def pack_tokens(root: Path, lengths: list[int], base: int = 0, shard_bytes: str = "2KB") -> tuple[str, list[np.ndarray]]:
    """A token dataset of documents of ``lengths`` tokens; every token id unique (base, base+1, ...)."""
    src = root / "src"
    src.mkdir(parents=True)
    offsets = np.concatenate(([0], np.cumsum(lengths))).astype(np.int64)
    tokens = np.arange(base, base + int(offsets[-1]), dtype=np.uint32)
    np.save(src / "t.npy", tokens)
    np.save(src / "t.docs.npy", offsets)
    url = str(root / "ds")
    shardkit.pack(str(src), url, shard_bytes=shard_bytes, token_dtype="uint32", progress=False)
    return url, [tokens[offsets[i]:offsets[i + 1]].astype(np.int64) for i in range(len(lengths))]


LENGTHS = [37, 0, 5, 120, 64, 3, 200, 17, 1, 90, 33, 64, 250, 12, 48]


@pytest.fixture(scope="module")
def docs_a(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[np.ndarray]]:
    return pack_tokens(tmp_path_factory.mktemp("tok_a"), LENGTHS)


@pytest.fixture(scope="module")
def docs_b(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[np.ndarray]]:
    rng = np.random.default_rng(3)
    return pack_tokens(tmp_path_factory.mktemp("tok_b"), rng.integers(0, 90, 40).tolist(), base=BASE_B)


def key(w: torch.Tensor) -> tuple[int, ...]:
    return tuple(w.tolist())


def expected_windows(docs: list[np.ndarray], block: int, respect: bool, eos: int | None, targets: bool) -> list[tuple]:
    """The windows, from a plain re-implementation of what the docs promise."""
    span = block + (1 if targets else 0)
    seqs = [list(d) + ([eos] if eos is not None else []) for d in docs]
    if not respect:
        seqs = [[t for s in seqs for t in s]]
    out = []
    for s in seqs:
        j = 0
        while j * block + span <= len(s):
            out.append(tuple(int(t) for t in s[j * block:j * block + span]))
            j += 1
    return out


def test_document_dtype_and_shard_count(docs_a):
    url, _ = docs_a
    ds = shardkit.open_dataset(url)
    assert ds.num_shards > 3  # windows cross shards
    assert ds.info["source"]["type"] == "tokens"


@pytest.mark.parametrize("respect", [False, True])
@pytest.mark.parametrize("eos,targets", [(None, True), (999_999, True), (None, False)])
def test_windows_concatenate_back_to_the_packed_tokens(docs_a, respect, eos, targets):
    url, docs = docs_a
    block = 16
    ts = TokenStream(url, block_size=block, respect_documents=respect, eos_token=eos, targets=targets)
    got = list(ts)
    span = block + (1 if targets else 0)
    assert all(w.dtype == torch.int64 and w.shape == (span,) for w in got)
    assert [key(w) for w in got] == expected_windows(docs, block, respect, eos, targets)
    assert len(got) == len(ts) == ts.num_windows[0]
    if not respect:  # the stream cut back together: the documents (with EOS) up to the dropped tail
        stream = np.concatenate([np.concatenate([d, [eos]]) if eos is not None else d for d in docs])
        cat = torch.cat([w[:block] for w in got] + ([got[-1][block:]] if targets else [])).numpy()
        assert len(stream) - len(cat) < span
        assert np.array_equal(cat, stream[:len(cat)])
    else:  # each document cut back together, its short tail dropped
        by_doc: dict[int, list[torch.Tensor]] = {}
        for w in got:
            first = int(w[0])
            d = next(i for i, doc in enumerate(docs) if len(doc) and doc[0] <= first <= doc[-1])
            by_doc.setdefault(d, []).append(w)
        for d, ws in by_doc.items():
            cat = torch.cat([w[:block] for w in ws] + ([ws[-1][block:]] if targets else [])).numpy()
            full = np.concatenate([docs[d], [eos]]) if eos is not None else docs[d]
            assert np.array_equal(cat, full[:len(cat)]) and len(full) - len(cat) < span
        short = [i for i, d in enumerate(docs) if len(d) + (eos is not None) < span]
        assert not set(short) & set(by_doc)


@pytest.mark.parametrize("cached", [False, True])
def test_big_documents_are_read_by_rows(docs_a, monkeypatch, tmp_path, cached):
    import shardkit.datasets.token_stream as mod

    url, docs = docs_a
    monkeypatch.setattr(mod, "_WHOLE_DOC", 50)  # documents over 50 tokens: only each window's rows are read
    monkeypatch.setattr(mod, "_RUN_DOC", 50)  # (and, without a cache, not read ahead in runs)
    calls = []
    real = mod.ShardDataset.read_array

    def spy(self, index, field="npy", rows=None):
        calls.append(rows)
        return real(self, index, field, rows)

    monkeypatch.setattr(mod.ShardDataset, "read_array", spy)
    ts = TokenStream(url, block_size=16, eos_token=7, shuffle=True, cache_dir=tmp_path / "c" if cached else None)
    got = sorted(key(w) for w in ts)
    assert got == sorted(expected_windows(docs, 16, False, 7, True))
    assert any(isinstance(r, slice) and r.stop - r.start <= 17 for r in calls)


def test_uncached_reads_documents_in_runs(tmp_path):
    rng = np.random.default_rng(11)
    url, docs = pack_tokens(tmp_path, rng.integers(1, 40, 400).tolist(), shard_bytes="64KB")
    ts = TokenStream(url, block_size=16)
    got = [key(w) for w in ts]
    assert got == expected_windows(docs, 16, False, None, True)
    requests = sum(r.stats()["requests"] for r in (ts._readers or {}).values())
    shards = shardkit.open_dataset(url).num_shards
    # One GET per run of neighbouring documents: a few per shard, not one per document.
    assert requests <= 4 * shards < len(docs) / 4, (requests, shards)


def test_corrupt_token_bytes_are_caught(tmp_path):
    url, docs = pack_tokens(tmp_path, [30, 30, 30], shard_bytes="64KB")
    ds = shardkit.open_dataset(url)
    row = ds.samples.to_pylist()[1]
    shard = Path(url) / ds.shard_list[row["shard"]].path
    data = bytearray(shard.read_bytes())
    data[row["offset"] + 512 + 128 + 4] ^= 0xFF  # a token of document 1: past its tar header and .npy header
    shard.write_bytes(bytes(data))
    with pytest.raises(shardkit.errors.IntegrityError, match="checksum"):
        list(TokenStream(url, block_size=8))


def test_a_manifest_count_that_lies_is_refused(docs_a, monkeypatch):
    url, _ = docs_a
    ts = TokenStream(url, block_size=8)
    ts.windows[0].doc_tokens[0] += 1  # the manifest says one token more than the shard holds
    with pytest.raises(shardkit.errors.ManifestError, match="does not hold the 38 tokens"):
        list(ts)


def test_shuffle_keeps_the_windows(docs_a):
    url, docs = docs_a
    plain = [key(w) for w in TokenStream(url, block_size=8)]
    mixed = [key(w) for w in TokenStream(url, block_size=8, shuffle=True, seed=5, shuffle_block=2)]
    assert sorted(mixed) == sorted(plain) and mixed != plain
    again = [key(w) for w in TokenStream(url, block_size=8, shuffle=True, seed=5, shuffle_block=2)]
    assert again == mixed  # deterministic from the seed


def test_ranks_and_workers_are_disjoint_equal_and_complete(docs_a):
    url, docs = docs_a
    every = expected_windows(docs, 8, False, None, True)
    per_rank = []
    for rank in range(3):
        ts = TokenStream(url, block_size=8, shuffle=True, seed=1, drop_last=True, rank=rank, world_size=3)
        loader = StreamingDataLoader(ts, batch_size=4, num_workers=2)
        got = [key(w) for batch in loader for w in batch]
        assert len(got) == len(ts) == len(every) // 3
        per_rank.append(got)
    flat = [w for r in per_rank for w in r]
    assert len(set(flat)) == len(flat)  # no window twice, across ranks and workers
    assert set(flat) <= set(every) and len(flat) == 3 * (len(every) // 3)


def test_resume_mid_epoch_with_another_world_size(docs_a):
    url, docs = docs_a
    every = expected_windows(docs, 8, False, None, True)
    n = len(every)
    k = next(k for k in range(3, n // 2) if (n - 2 * k) % 3 == 0)  # the rest splits evenly over 3 ranks
    seen: list[tuple] = []
    state = None
    for rank in range(2):
        ts = TokenStream(url, block_size=8, shuffle=True, seed=2, drop_last=True, rank=rank, world_size=2)
        it = iter(ts)
        seen += [key(next(it)) for _ in range(k)]
        state = ts.state_dict(consumed=k)
    rest: list[tuple] = []
    for rank in range(3):
        ts = TokenStream(url, block_size=8, shuffle=True, seed=2, drop_last=True, rank=rank, world_size=3)
        ts.load_state_dict(state)
        rest += [key(w) for w in ts]
    assert len(seen + rest) == n and set(seen + rest) == set(every)  # nothing lost, nothing repeated


def test_loader_resume_with_another_worker_count(docs_a):
    url, docs = docs_a
    every = set(expected_windows(docs, 8, True, None, False))
    ts = TokenStream(url, block_size=8, respect_documents=True, targets=False, shuffle=True, seed=4)
    loader = StreamingDataLoader(ts, batch_size=3, num_workers=2)
    seen = []
    for step, batch in enumerate(loader):
        seen += [key(w) for w in batch]
        if step == 2:
            state = loader.state_dict()
            break
    ts2 = TokenStream(url, block_size=8, respect_documents=True, targets=False, shuffle=True, seed=4)
    loader2 = StreamingDataLoader(ts2, batch_size=5, num_workers=1)
    loader2.load_state_dict(state)
    rest = [key(w) for batch in loader2 for w in batch]
    assert len(seen) + len(rest) == len(every) and set(seen + rest) == every


def test_mixture_by_weights(docs_a, docs_b):
    (ua, da), (ub, db) = docs_a, docs_b
    wa, wb = set(expected_windows(da, 8, False, None, True)), set(expected_windows(db, 8, False, None, True))
    shares = [Share(weight=3.0), Share(weight=1.0)]
    ts = TokenStream([Stream(ua, weight=3.0), Stream(ub, weight=1.0)], block_size=8, shuffle=True, seed=9,
                     epoch_size=100)
    assert ts.num_windows == [len(wa), len(wb)]
    got = [key(w) for w in ts]
    from_b = [w for w in got if w[0] >= BASE_B]
    from_a = [w for w in got if w[0] < BASE_B]
    assert set(from_a) <= wa and set(from_b) <= wb
    counts = mixture_counts([len(wa), len(wb)], shares, 100)
    assert [len(from_a), len(from_b)] == list(counts) and sum(counts) == 100
    # Interleaved at a fine grain: every prefix holds B's share within about one window.
    firsts = np.cumsum([w[0] >= BASE_B for w in got])
    assert np.all(np.abs(firsts - np.arange(1, 101) * counts[1] / 100) <= 2)
    # Each stream's windows repeat only as its count needs (A is upsampled, B is a subset).
    assert max(Counter(from_b).values()) == 1
    assert max(Counter(from_a).values()) <= -(-counts[0] // len(wa))


def test_mixture_resumes_under_other_weights_without_repeats(docs_a, docs_b):
    (ua, _), (ub, _) = docs_a, docs_b
    streams = [Stream(ua, weight=1.0), Stream(ub, weight=1.0)]
    ts = TokenStream(streams, block_size=8, shuffle=True, seed=3)
    it = iter(ts)
    seen = [key(next(it)) for _ in range(20)]
    state = ts.state_dict(consumed=20)
    ts2 = TokenStream([Stream(ua, weight=1.0), Stream(ub, weight=4.0)], block_size=8, shuffle=True, seed=3)
    ts2.load_state_dict(state)
    rest = [key(w) for w in ts2]
    assert not set(seen) & set(rest) and len(set(rest)) == len(rest)


def test_not_a_token_dataset_is_refused_in_one_line(tmp_path):
    url, _ = pack_random(tmp_path, n=10, max_body=50, classes=2, shard_bytes="1KB", seed=1, prefix="r-")
    with pytest.raises(ConfigError) as info:
        TokenStream(url, block_size=8)
    msg = str(info.value)
    assert "\n" not in msg and "not a token dataset" in msg and "--token-dtype" in msg


def test_states_of_other_windows_are_refused(docs_a):
    url, _ = docs_a
    ts = TokenStream(url, block_size=8)
    state = ts.state_dict(consumed=0)
    for other in (TokenStream(url, block_size=16), TokenStream(url, block_size=8, respect_documents=True),
                  TokenStream(url, block_size=8, eos_token=7)):
        with pytest.raises(ConfigError, match="saved with"):
            other.load_state_dict(state)
    with pytest.raises(ConfigError, match="not saved by a TokenStream"):
        ts.load_state_dict(shardkit.StreamingDataset(url).state_dict())
    with pytest.raises(ConfigError):
        TokenStream(url, block_size=0)


def test_from_s3_through_one_node_cache(s3_env, s3_bucket, docs_a, tmp_path):
    url, docs = docs_a
    dest = f"{s3_bucket}/tok"
    src = Path(url).parent / "src"
    shardkit.pack(str(src), dest, shard_bytes="2KB", token_dtype="uint32", progress=False)
    every = expected_windows(docs, 8, False, 0, True)
    got = []
    for rank in range(2):
        ts = TokenStream(dest, block_size=8, eos_token=0, cache_dir=tmp_path / "cache", rank=rank, world_size=2,
                         drop_last=True)
        got += [key(w) for w in ts]
        # The epoch's end unpins the shards it held open in the node cache (eviction may take them).
        assert all(not r._cache._open for r in (ts._readers or {}).values() if r._cache is not None)
    assert len(got) == len(set(got)) == 2 * (len(every) // 2) and set(got) <= set(every)
    assert any((tmp_path / "cache").rglob("*.tar*"))  # the shards went through the node cache
    plain = TokenStream(dest, block_size=8, eos_token=0)
    uncached = [key(w) for w in plain]
    assert uncached == every  # ranged reads of the token rows, no cache
    stats = plain.stats()
    assert stats["samples"] == len(every) and stats["bytes_fetched"] > 0


WORKER = Path(__file__).resolve().parents[1] / "ddp_token_worker.py"


def run_ranks(tmp: Path, world: int, timeout: float = 180, **cfg: Any) -> list[dict[str, Any]]:
    tag = uuid.uuid4().hex[:8]
    return launch(WORKER, [{**cfg, "out": str(tmp / f"tok-{world}-{rank}-{tag}.json")} for rank in range(world)],
                  timeout=timeout)


@pytest.mark.slow
def test_ddp_two_ranks_two_workers_stop_and_resume_with_three_ranks(s3_env, s3_bucket, docs_a, docs_b, tmp_path):
    urls, every = [], []
    for i, (url, docs) in enumerate((docs_a, docs_b)):
        urls.append(f"{s3_bucket}/tok{i}")
        shardkit.pack(str(Path(url).parent / "src"), urls[-1], shard_bytes="2KB", token_dtype="uint32",
                      progress=False)
        every += expected_windows(docs, 8, False, 0, True)
    cfg = {"urls": urls, "block_size": 8, "cache_dir": str(tmp_path / "cache"), "batch_size": 4, "num_workers": 2}
    first = run_ranks(tmp_path, 2, stop_after=5, **cfg)
    assert [r["steps"] for r in first] == [5, 5] and first[0]["len"] == first[1]["len"]
    state = tmp_path / "state.json"
    state.write_text(json.dumps(first[0]["state"]))
    second = run_ranks(tmp_path, 3, state_in=str(state), **cfg)
    assert len({len(r["windows"]) for r in second}) == 1  # equal counts per rank
    got = Counter(tuple(w) for r in first + second for w in r["windows"])
    left = len(every) - 2 * 5 * 4
    pad = -left % 3  # without drop_last the last short share is padded by repeating windows
    assert set(got) == set(every)  # nothing lost
    assert sum(got.values()) == len(every) + pad and sum(c - 1 for c in got.values()) == pad  # nothing else repeated
    assert len([d for d in os.listdir(tmp_path / "cache") if not d.startswith(".")]) == 2  # one cache, a namespace each
