"""shardkit rows: pack to S3, then StreamingDataset through a DataLoader.

Per-sample mode (one dict per sample, DataLoader batches with shardkit's collate) and
in-worker batching (``batch_size=256`` + ``DataLoader(batch_size=None)``), each cold (empty
node cache, shards from S3) then warm (second epoch from the cache), and decoded
(``CenterCrop(224)``, warm cache).
"""

from __future__ import annotations

import os
import shutil
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks.common import failed_row, row  # noqa: E402
from benchmarks.peers._base import epoch_row, finish, guarded, load_config, loader  # noqa: E402

TOOL = "shardkit"


def storage_options() -> dict[str, Any]:
    return {"key": os.environ["AWS_ACCESS_KEY_ID"], "secret": os.environ["AWS_SECRET_ACCESS_KEY"],
            "client_kwargs": {"endpoint_url": os.environ["AWS_ENDPOINT_URL"], "region_name": "us-east-1"}}


def reopen_storage(_worker: int) -> None:
    """Workaround: a forked DataLoader worker inherits the parent's s3fs client, which refuses
    to run after fork ("This class is not fork-safe"); drop it so the worker opens its own."""
    from torch.utils.data import get_worker_info

    info = get_worker_info()
    store = getattr(getattr(info.dataset, "ds", None), "store", None) if info else None
    if store is not None and getattr(store, "_fs", None) is not None:
        store._fs = None
        if hasattr(store, "_boto3"):
            store._boto3 = None


def main() -> None:
    import shardkit
    from shardkit.batching import collate

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

    def stream(cache: str, batched: bool, decode: Any = None) -> Any:
        return shardkit.StreamingDataset(url, cache_dir=cache, cache_limit="50GB", shuffle=False, decode=decode,
                                         batch_size=256 if batched else None, storage_options=opts)

    def make(ds: Any, batched: bool) -> Any:
        if batched:
            return lambda: loader(ds, batch_size=None, worker_init_fn=reopen_storage)
        return lambda: loader(ds, collate_fn=collate, worker_init_fn=reopen_storage)

    for batched, label in ((False, "per-sample dicts"), (True, "in-worker batches")):
        cache = os.path.join(work, "cache-batched" if batched else "cache")
        shutil.rmtree(cache, ignore_errors=True)
        names = [(f"shardkit {label}, cold", "cold"), (f"shardkit {label}, warm", "warm"),
                 (f"shardkit {label}, decoded", "decoded")]
        if packed["status"] != "ok":
            rows.extend(failed_row(nm, g, TOOL, "pack failed") for nm, g in names)
            continue
        ds = stream(cache, batched)
        for nm, g in names[:2]:
            guarded(rows, nm, g, TOOL, lambda nm=nm, g=g: epoch_row(nm, g, TOOL, make(ds, batched), nbytes, n,
                                                                    batched=batched))
        nm, g = names[2]
        guarded(rows, nm, g, TOOL,
                lambda nm=nm, g=g: epoch_row(nm, g, TOOL, make(stream(cache, batched, shardkit.CenterCrop(224)),
                                                               batched), nbytes, n, batched=batched))
    finish(rows, ["shardkit", "torch", "pillow", "numpy", "pyarrow", "s3fs"])


if __name__ == "__main__":
    main()
