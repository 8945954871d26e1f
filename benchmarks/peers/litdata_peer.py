"""LitData (0.2.x): ``optimize`` to S3, then its StreamingDataset through a torch DataLoader.

obstore refuses ``http://`` endpoints: ``_litdata_site/sitecustomize.py`` (on PYTHONPATH for
this process and the workers ``optimize`` spawns) adds ``allow_http`` to its client options.
Rows: first epoch (cold: chunks from S3), second epoch (warm: local cache), decoded (warm,
through LitData's own ``transform=``).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
os.environ["PYTHONPATH"] = os.pathsep.join([os.path.join(HERE, "_litdata_site"), os.environ.get("PYTHONPATH", "")])
os.environ["AWS_ALLOW_HTTP"] = "true"

from benchmarks.common import failed_row, row  # noqa: E402
from benchmarks.peers._base import Crop, epoch_row, finish, guarded, list_images, load_config, loader  # noqa: E402

TOOL = "litdata"


def to_sample(item: tuple[str, int]) -> dict[str, Any]:
    path, label = item
    with open(path, "rb") as f:
        return {"jpg": f.read(), "cls": label}


def main() -> None:
    import litdata as ld
    import litdata.streaming.downloader as dl

    dl._OBSTORE_CLIENT_OPTIONS = {**dict(dl._OBSTORE_CLIENT_OPTIONS), "allow_http": True}
    cfg = load_config()
    items = list_images(cfg["images_dir"])
    n, nbytes, bucket, work = len(items), int(cfg["total_bytes"]), cfg["bucket"], cfg["work"]
    remote = f"s3://{bucket}/litdata"
    rows: list[dict[str, Any]] = []

    def pack() -> dict[str, Any]:
        t0 = time.perf_counter()
        ld.optimize(fn=to_sample, inputs=items, output_dir=remote, chunk_bytes=cfg["shard_bytes"].replace("B", "b"),
                    num_workers=2, mode="overwrite")
        return row("LitData optimize to S3", "pack", TOOL, kind="pack", samples=n,
                   seconds=time.perf_counter() - t0, nbytes=nbytes)

    packed = guarded(rows, "LitData optimize to S3", "pack", TOOL, pack, kind="pack")
    names = [(f"LitData StreamingDataset, {g}", g) for g in ("cold", "warm", "decoded")]
    if packed["status"] != "ok":
        rows.extend(failed_row(nm, g, TOOL, "pack failed: " + packed["reason"]) for nm, g in names)
        finish(rows, ["litdata", "obstore", "torch", "boto3"])
        return
    cache = os.path.join(work, "cache")
    raw = ld.StreamingDataset(remote, cache_dir=cache, shuffle=False)
    for nm, g in names[:2]:
        guarded(rows, nm, g, TOOL, lambda nm=nm, g=g: epoch_row(nm, g, TOOL, lambda: loader(raw), nbytes, n))
    nm, g = names[2]
    guarded(rows, nm, g, TOOL, lambda: epoch_row(
        nm, g, TOOL, lambda: loader(ld.StreamingDataset(remote, cache_dir=cache, shuffle=False, transform=Crop())),
        nbytes, n))
    finish(rows, ["litdata", "obstore", "torch", "boto3"])


if __name__ == "__main__":
    main()
