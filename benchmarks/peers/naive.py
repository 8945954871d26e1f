"""The baselines users start from: one S3 object per image, one local file per image.

Rows: ``boto3 get_object`` per sample (cold: S3 every epoch), local open+read per file
(warm: page cache), ``cv2.imread`` + centre crop per file (decoded). Pack row: uploading the
objects (boto3 ``put_object``, 8 threads).
"""

from __future__ import annotations

import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks.common import boto3_client, failed_row, row  # noqa: E402
from benchmarks.peers._base import Crop, epoch_row, finish, guarded, list_images, load_config, loader  # noqa: E402

TOOL = "naive"


class S3Objects:
    """Map-style: one ``get_object`` per sample; the client is made lazily in each worker."""

    def __init__(self, bucket: str, keys: list[str], labels: list[int], decode: Any = None) -> None:
        self.bucket, self.keys, self.labels, self.decode = bucket, keys, labels, decode
        self._client: Any = None

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, i: int) -> dict[str, Any]:
        if self._client is None:
            self._client = boto3_client()
        data = self._client.get_object(Bucket=self.bucket, Key=self.keys[i])["Body"].read()
        s = {"jpg": data, "cls": self.labels[i]}
        return self.decode(s) if self.decode else s


class Files:
    def __init__(self, items: list[tuple[str, int]]) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, Any]:
        path, label = self.items[i]
        with open(path, "rb") as f:
            return {"jpg": f.read(), "cls": label}


class Cv2Files(Files):
    """cv2.imread, then CenterCrop's geometry: shorter side to 256 (bilinear), centre 224, RGB."""

    def __getitem__(self, i: int) -> dict[str, Any]:
        import cv2

        path, label = self.items[i]
        img = cv2.imread(path, cv2.IMREAD_COLOR)
        if img is None:
            raise OSError(f"cv2.imread could not read {path}")
        h, w = img.shape[:2]
        if min(h, w) != 256:
            s = 256 / min(h, w)
            img = cv2.resize(img, (max(256, round(w * s)), max(256, round(h * s))), interpolation=cv2.INTER_LINEAR)
            h, w = img.shape[:2]
        top, left = (h - 224) // 2, (w - 224) // 2
        crop = cv2.cvtColor(img[top:top + 224, left:left + 224], cv2.COLOR_BGR2RGB)
        return {"jpg": crop, "cls": label}


def main() -> None:
    cfg = load_config()
    items = list_images(cfg["images_dir"])
    n, nbytes = len(items), int(cfg["total_bytes"])
    bucket = cfg["bucket"]
    keys = [f"objects/{os.path.basename(os.path.dirname(p))}/{os.path.basename(p)}" for p, _ in items]
    labels = [lab for _, lab in items]
    rows: list[dict[str, Any]] = []

    def upload() -> dict[str, Any]:
        client = boto3_client()

        def put(i: int) -> None:
            with open(items[i][0], "rb") as f:
                client.put_object(Bucket=bucket, Key=keys[i], Body=f.read())

        t0 = time.perf_counter()
        with ThreadPoolExecutor(8) as ex:
            list(ex.map(put, range(n)))
        return row("S3 object per image: put_object x8 threads", "pack", TOOL, kind="pack", samples=n,
                   seconds=time.perf_counter() - t0, nbytes=nbytes)

    up = guarded(rows, "S3 object per image: put_object x8 threads", "pack", TOOL, upload, kind="pack")
    name = "S3 object per image (boto3 get_object)"
    if up["status"] == "ok":
        guarded(rows, name, "cold", TOOL,
                lambda: epoch_row(name, "cold", TOOL, lambda: loader(S3Objects(bucket, keys, labels)), nbytes, n))
    else:
        rows.append(failed_row(name, "cold", TOOL, "upload failed: " + up["reason"]))
    name = "local files, open+read per file"
    guarded(rows, name, "warm", TOOL, lambda: epoch_row(name, "warm", TOOL, lambda: loader(Files(items)), nbytes, n))
    name = "local files, cv2.imread + crop per file"
    try:
        import cv2  # noqa: F401
    except ImportError as exc:
        rows.append(failed_row(name, "decoded", TOOL, f"cv2 not installed ({exc})", status="not available"))
    else:
        guarded(rows, name, "decoded", TOOL,
                lambda: epoch_row(name, "decoded", TOOL, lambda: loader(Cv2Files(items)), nbytes, n))
    if cfg.get("pil_files"):
        name = "local files, PIL CenterCrop per file"
        crop = Crop()

        class PilFiles(Files):
            def __getitem__(self, i: int) -> dict[str, Any]:
                return crop(super().__getitem__(i))

        guarded(rows, name, "decoded", TOOL,
                lambda: epoch_row(name, "decoded", TOOL, lambda: loader(PilFiles(items)), nbytes, n))
    finish(rows, ["boto3", "opencv-python-headless", "pillow", "torch"])


if __name__ == "__main__":
    main()
