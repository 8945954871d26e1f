"""The small, real inputs the documentation's code examples run against.

The pages use the paths a user would (``./imagenet/train``, ``./volumes``, ``./big.h5``...);
:func:`make_sources` writes tiny versions of them once per session, and each page's working
directory links to them. :data:`DATASETS` packs the datasets a page reads without packing
them itself (a page names those in a ``<!-- snippet: needs s3://shardkit/... -->`` comment).
"""

from __future__ import annotations

import io
import tarfile
from pathlib import Path
from typing import Any, Callable

import numpy as np

__all__ = ["BUCKET", "DATASETS", "SOURCES", "make_sources"]

# The bucket every example uses: the one docker-compose's MinIO creates (docs/guide/local-stack.md).
BUCKET = "shardkit"

# What each page's working directory holds, relative to it.
SOURCES = ("imagenet", "volumes", "big.h5", "rows.h5", "files.csv", "keyed", "wds", "train.tfrecord")


def _tar(path: Path, members: list[tuple[str, bytes]]) -> None:
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def make_sources(root: Path) -> Path:
    """Write every input the examples name under ``root`` (a few MB; about a second)."""
    import h5py

    from shardkit.dev.sampledata import make_image_folder

    rng = np.random.default_rng(0)
    images = make_image_folder(root / "imagenet" / "train", 40, side=96, quality=80)
    jpgs = sorted(images.rglob("*.jpg"))
    # Arrays larger than one 1 MiB checksum block, so partial reads are checked per block.
    (root / "volumes").mkdir()
    for i in range(3):
        np.save(root / "volumes" / f"vol{i:03d}.npy", rng.random((1200, 64, 16), dtype=np.float32))
    with h5py.File(root / "big.h5", "w") as f:
        f["volume_a"] = rng.random((600, 64, 16), dtype=np.float32)
        f["volume_b"] = rng.random((600, 64, 16), dtype=np.float32)
    with h5py.File(root / "rows.h5", "w") as f:
        f["x"] = rng.random((500, 64), dtype=np.float32)
        f["y"] = np.arange(500, dtype=np.int64) % 10
    lines = ["path,label,photographer"]
    lines += [f"{p.relative_to(root)},{'cat' if i % 2 else 'dog'},{i:05d}" for i, p in enumerate(jpgs[:12])]
    (root / "files.csv").write_text("\n".join(lines) + "\n")
    (root / "keyed").mkdir()
    for i, p in enumerate(jpgs[:8]):
        (root / "keyed" / f"{i:04d}.jpg").write_bytes(p.read_bytes())
        (root / "keyed" / f"{i:04d}.cls").write_text(str(i % 2))
    (root / "wds").mkdir()
    for t in range(3):
        members = []
        for i in range(t * 4, t * 4 + 4):
            members += [(f"{i:06d}.jpg", jpgs[i].read_bytes()), (f"{i:06d}.cls", str(i % 10).encode())]
        _tar(root / "wds" / f"shard-{t:06d}.tar", members)
    _tfrecord(root / "train.tfrecord", jpgs[:8])
    return root


def _tfrecord(path: Path, jpgs: list[Path]) -> None:
    from tfrecords import encode_example, write_tfrecord

    write_tfrecord(path, [encode_example({"image/encoded": [p.read_bytes()], "image/format": [b"jpeg"],
                                          "label": [i % 2]}, packed=True) for i, p in enumerate(jpgs)])


def _pack(source: str, **options: Any) -> Callable[[Path, str], None]:
    def run(sources: Path, url: str) -> None:
        import shardkit

        shardkit.pack(str(sources / source), url, progress=False, **options)

    return run


# URL -> how the session makes it. Shards are small on purpose: every example then reads
# several shards, as it would at full size.
DATASETS: dict[str, Callable[[Path, str], None]] = {
    f"s3://{BUCKET}/imagenet": _pack("imagenet/train", labels_from_dirs=True, shard_bytes="64KB"),
    f"s3://{BUCKET}/volumes": _pack("volumes"),
}
