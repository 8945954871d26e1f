"""The quick-start job: make a real image data set, pack it, stream it, print the figures.

``python -m shardkit.dev.demo`` (or ``make demo``) runs everything locally with no server:
2,000 ~100 KB JPEGs made from scikit-image's bundled photos, packed into shards on a local
store, then read back through a torch DataLoader (2 workers): raw bytes and decoded 224x224
crops, beside the one-file-per-image baseline on the same images.
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path
from typing import Any, Callable

from torch.utils.data import Dataset

from shardkit.batch.codecs import CenterCrop

__all__ = ["main"]


def _read_payload(batch: dict[str, Any]) -> int:
    """Read every cache line of a batch's payload (a strided sum), the same for every row: a
    zero-copy batch must not look fast because nobody looked at its bytes."""
    import numpy as np

    total = 0
    for key, value in batch.items():
        if key.startswith("__") or key.endswith(".offsets"):
            continue
        items = value if isinstance(value, list) else [value]
        parts = [np.asarray(memoryview(x.numpy() if hasattr(x, "numpy") else x)).reshape(-1).view(np.uint8)
                 for x in items if x is not None and not isinstance(x, (str, int))]
        if parts:
            np.concatenate([p[::64] for p in parts]).sum()  # the reads are the point, not the sum
            total += sum(p.nbytes for p in parts)
    return total


def _timed_epoch(make_loader: Callable[[], Any]) -> tuple[float, int, int]:
    loader = make_loader()
    t0 = time.perf_counter()
    samples = nbytes = 0
    for batch in loader:
        samples += len(batch["__key__"])
        nbytes += _read_payload(batch)
    return time.perf_counter() - t0, samples, nbytes


class _FileImages(Dataset):  # type: ignore[type-arg]
    """The naive baseline: one file open + read (+ decode) per sample."""

    def __init__(self, root: Path, decode: Callable[[dict[str, Any]], Any] | None) -> None:
        self.files = sorted(root.rglob("*.jpg"))
        self.decode = decode

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> dict[str, Any]:
        data = self.files[i].read_bytes()
        sample = {"__key__": self.files[i].stem, "__index__": i, "jpg": data}
        return self.decode(sample) if self.decode else sample


def main(argv: list[str] | None = None) -> int:
    """Run the demo: make the images, pack them, time each way of reading them, print the table.

    Args:
        argv: the command line (``--images``, ``--workdir``, ``--workers``, ``--batch-size``);
            None reads ``sys.argv``.

    Returns:
        The exit status, 0.

    Raises:
        ConfigError: scikit-image, whose bundled photos the images are made from, is missing.
    """
    from torch.utils.data import DataLoader

    from shardkit import StreamingDataLoader, StreamingDataset, pack
    from shardkit.batch.collate import collate
    from shardkit.dev.sampledata import make_image_folder

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--images", type=int, default=2000)
    p.add_argument("--workdir", default="demo-data")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=128)
    args = p.parse_args(argv)

    work = Path(args.workdir)
    t0 = time.perf_counter()
    images = make_image_folder(work / "images", args.images)
    total = sum(f.stat().st_size for f in images.rglob("*.jpg"))
    print(f"made {args.images} JPEGs ({total / 1e6:.1f} MB) from real photos in {time.perf_counter() - t0:.1f}s -> {images}")

    store = work / "store"
    info = pack(str(images), str(store), shard_bytes="32MB", labels_from_dirs=True, overwrite=True, progress=False)
    print(f"packed into {info['num_shards']} shards in {info['elapsed_seconds']:.2f}s "
          f"({info['total_bytes'] / 1e6 / info['elapsed_seconds']:.0f} MB/s) -> {store}")

    cache = work / "cache"
    shutil.rmtree(cache, ignore_errors=True)
    bs, nw = args.batch_size, args.workers

    def stream(decode: Any, zero_copy: bool = False) -> Callable[[], Any]:
        ds = StreamingDataset(str(store), cache_dir=str(cache), cache_limit="2GB", shuffle=True, decode=decode,
                              batch_size=bs, zero_copy=zero_copy)
        # zero_copy: views into the cache files, in this process (a map cannot leave it).
        return lambda: StreamingDataLoader(ds, num_workers=0 if zero_copy else nw)

    def files(decode: Any) -> Callable[[], Any]:
        ds = _FileImages(images, decode)
        return lambda: DataLoader(ds, batch_size=bs, num_workers=nw, shuffle=True, collate_fn=collate)

    rows = [
        ("shardkit raw, cold cache", stream(None)),
        ("shardkit raw, warm cache", stream(None)),
        ("shardkit raw zero-copy, warm cache", stream(None, zero_copy=True)),
        ("files raw (one open per image)", files(None)),
        ("shardkit decode+crop 224", stream(CenterCrop(224))),
        ("files decode+crop 224", files(CenterCrop(224))),
    ]
    print(f"\nreading {args.images} samples, DataLoader {nw} workers (zero-copy: in-process), batch {bs}:")
    print(f"{'path':34s} {'samples/s':>10s} {'MB/s':>8s}")
    results = {}
    for name, make in rows:
        seconds, n, _ = _timed_epoch(make)
        rate = n / seconds
        mbs = total / seconds / 1e6
        results[name] = rate
        print(f"{name:34s} {rate:10.0f} {mbs:8.1f}")
    per_file = results["files raw (one open per image)"]
    print(f"\nraw warm vs one-file-per-image: {results['shardkit raw, warm cache'] / per_file:.1f}x "
          f"({results['shardkit raw zero-copy, warm cache'] / per_file:.1f}x zero-copy);"
          f" decoded: {results['shardkit decode+crop 224'] / results['files decode+crop 224']:.2f}x"
          " (decode-bound on 2 cores; see benchmarks/RESULTS.md for S3 and peers)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
