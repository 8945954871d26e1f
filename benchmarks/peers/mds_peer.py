"""MosaicML Streaming (0.10.0): MDSWriter straight to S3 (its S3 uploader reads
S3_ENDPOINT_URL), then its StreamingDataset with a local cache through a torch DataLoader.

Rows: first epoch (cold: shards from S3), second epoch (warm: local cache), decoded (warm).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks.common import failed_row, row  # noqa: E402
from benchmarks.peers._base import Crop, epoch_row, finish, guarded, list_images, load_config, loader  # noqa: E402

TOOL = "mosaicml-streaming"


def main() -> None:
    from streaming import MDSWriter, StreamingDataset
    from streaming.base.util import clean_stale_shared_memory

    from shardkit.config import parse_size

    clean_stale_shared_memory()
    cfg = load_config()
    items = list_images(cfg["images_dir"])
    n, nbytes, bucket, work = len(items), int(cfg["total_bytes"]), cfg["bucket"], cfg["work"]
    remote = f"s3://{bucket}/mds"
    rows: list[dict[str, Any]] = []

    def pack() -> dict[str, Any]:
        t0 = time.perf_counter()
        with MDSWriter(out=remote, columns={"jpg": "bytes", "cls": "int"}, compression=None,
                       size_limit=parse_size(cfg["shard_bytes"], "shard_bytes"), progress_bar=False) as w:
            for path, label in items:
                with open(path, "rb") as f:
                    w.write({"jpg": f.read(), "cls": label})
        return row("MosaicML MDSWriter to S3", "pack", TOOL, kind="pack", samples=n,
                   seconds=time.perf_counter() - t0, nbytes=nbytes)

    packed = guarded(rows, "MosaicML MDSWriter to S3", "pack", TOOL, pack, kind="pack")
    names = [(f"MosaicML Streaming, {g}", g) for g in ("cold", "warm", "decoded")]
    if packed["status"] != "ok":
        rows.extend(failed_row(nm, g, TOOL, "pack failed: " + packed["reason"]) for nm, g in names)
        finish(rows, ["mosaicml-streaming", "torch", "boto3"])
        return

    class Decoding(StreamingDataset):
        """Their documented pattern: subclass and transform in __getitem__."""

        crop: Any = None

        def __getitem__(self, idx: Any) -> Any:
            s = super().__getitem__(idx)
            return self.crop(s) if self.crop is not None else s

    ds = Decoding(remote=remote, local=os.path.join(work, "cache"), shuffle=False, batch_size=256)
    for (nm, g), crop in zip(names, (None, None, Crop())):
        def one(nm: str = nm, g: str = g, crop: Any = crop) -> dict[str, Any]:
            ds.crop = crop  # workers get a fresh copy of the dataset at each epoch's start
            return epoch_row(nm, g, TOOL, lambda: loader(ds), nbytes, n)

        guarded(rows, nm, g, TOOL, one)
    finish(rows, ["mosaicml-streaming", "torch", "boto3", "numpy"])


if __name__ == "__main__":
    main()
