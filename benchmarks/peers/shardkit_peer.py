"""shardkit rows: pack to S3, then StreamingDataset through a DataLoader.

Per-sample mode (one dict per sample, torch DataLoader batches with shardkit's collate),
batches in the main process (``batch_size=256`` + ``shardkit.StreamingDataLoader(num_workers=0)``:
zero-copy views, and packed batches filled by 2 read threads) and in-worker batching (2
workers, once with the shared ring handoff and once with ``handoff="copy"``), each cold (empty node cache, shards from S3) then
warm (second epoch from the cache), and decoded (``CenterCrop(224)``, warm cache).
Every row's consumer reads every payload byte it receives (``benchmarks.common.touch_count``).
"""

from __future__ import annotations

import os
import shutil
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks.common import failed_row, row  # noqa: E402
from benchmarks.peers._base import WORKERS, epoch_row, finish, guarded, load_config, loader  # noqa: E402

TOOL = "shardkit"


def storage_options() -> dict[str, Any]:
    return {"key": os.environ["AWS_ACCESS_KEY_ID"], "secret": os.environ["AWS_SECRET_ACCESS_KEY"],
            "client_kwargs": {"endpoint_url": os.environ["AWS_ENDPOINT_URL"], "region_name": "us-east-1"}}


def main() -> None:
    import shardkit
    from shardkit.batch.collate import collate

    cfg = load_config()
    n, nbytes = int(cfg["num_images"]), int(cfg["total_bytes"])
    url = f"s3://{cfg['bucket']}/shardkit"
    work = cfg["work"]
    rows: list[dict[str, Any]] = []
    opts = storage_options()

    def do_pack() -> dict[str, Any]:
        info = shardkit.pack(cfg["images_dir"], url, shard_bytes=cfg["shard_bytes"], labels_from_dirs=True,
                             overwrite=True, storage_options=opts, progress=False)
        return row("shardkit pack (local engine)", "pack", TOOL, kind="pack", samples=info["num_samples"],
                   seconds=info["elapsed_seconds"], nbytes=nbytes, shards=info["num_shards"])

    packed = guarded(rows, "shardkit pack (local engine)", "pack", TOOL, do_pack, kind="pack")

    def stream(cache: str, batched: bool, decode: Any = None, zero_copy: bool = False) -> Any:
        return shardkit.StreamingDataset(url, cache_dir=cache, cache_limit="50GB", shuffle=False, decode=decode,
                                         batch_size=256 if batched else None, storage_options=opts,
                                         zero_copy=zero_copy)

    def per_sample(ds: Any) -> Any:
        return lambda: loader(ds, collate_fn=collate, persistent_workers=False)

    def batches(ds: Any, handoff: str) -> Any:
        # Batches go through shardkit.StreamingDataLoader (what its docs use): in workers, with
        # a raw (decode=None) stream "auto" picks the shared ring, "copy" forces DataLoader
        # pickling; "main" is num_workers=0: the dataset's 2 read threads fill packed batches,
        # or (zero_copy) no copy is made at all.
        if handoff == "main":
            return lambda: shardkit.StreamingDataLoader(ds, num_workers=0)
        return lambda: shardkit.StreamingDataLoader(ds, num_workers=WORKERS, handoff=handoff,
                                                    persistent_workers=False)

    plans = [("per-sample dicts", None, "cache"),
             ("zero-copy views (num_workers=0)", "main", "cache-zero-copy"),
             ("packed batches, 2 read threads (num_workers=0)", "main", "cache-threads"),
             ("in-worker batches (ring handoff)", "ring", "cache-ring"),
             ("in-worker batches (copy handoff)", "copy", "cache-copy")]
    for label, handoff, cache_name in plans:
        cache = os.path.join(work, cache_name)
        shutil.rmtree(cache, ignore_errors=True)
        names = [(f"shardkit {label}, cold", "cold"), (f"shardkit {label}, warm", "warm")]
        if packed["status"] != "ok":
            rows.extend(failed_row(nm, g, TOOL, "pack failed") for nm, g in names)
            continue
        ds = stream(cache, handoff is not None, zero_copy=label.startswith("zero-copy"))
        make = per_sample(ds) if handoff is None else batches(ds, handoff)
        for nm, g in names:
            guarded(rows, nm, g, TOOL, lambda nm=nm, g=g: epoch_row(nm, g, TOOL, make, nbytes, n,
                                                                    batched=handoff is not None))
    # Decoded, from the warm cache: decoded batches always use the copy path (stacked crops).
    # Training keeps one loader for every epoch: a later epoch with persistent workers has no
    # worker start-up and reuses the ring's mapped pages (shardkit only; no peer row to match).
    steady_name = "shardkit in-worker batches (ring handoff), warm, 3rd epoch of one loader (persistent workers)"
    if packed["status"] == "ok":
        def steady_row() -> dict[str, Any]:
            steady = shardkit.StreamingDataLoader(stream(os.path.join(work, "cache-ring"), True),
                                                  num_workers=WORKERS, persistent_workers=True)
            for _ in range(2):
                for _batch in steady:
                    pass
            return epoch_row(steady_name, "warm", TOOL, lambda: steady, nbytes, n, epochs=1, batched=True)
        guarded(rows, steady_name, "warm", TOOL, steady_row)
    else:
        rows.append(failed_row(steady_name, "warm", TOOL, "pack failed"))
    decoded = [("shardkit per-sample dicts, decoded", None), ("shardkit in-worker batches, decoded", "auto")]
    for nm, handoff in decoded:
        if packed["status"] != "ok":
            rows.append(failed_row(nm, "decoded", TOOL, "pack failed"))
            continue
        cache = os.path.join(work, "cache-ring")
        ds_fn = (lambda handoff=handoff, cache=cache: stream(cache, handoff is not None, shardkit.CenterCrop(224)))
        guarded(rows, nm, "decoded", TOOL,
                lambda nm=nm, handoff=handoff, ds_fn=ds_fn: epoch_row(
                    nm, "decoded", TOOL, per_sample(ds_fn()) if handoff is None else batches(ds_fn(), handoff),
                    nbytes, n, batched=handoff is not None))
    finish(rows, ["shardkit", "torch", "pillow", "numpy", "pyarrow", "s3fs"])


if __name__ == "__main__":
    main()
