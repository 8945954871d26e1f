"""What every peer script shares: its config, the decode transform, the loader settings.

Run as scripts, peers import this module by path (``benchmarks`` is on PYTHONPATH).
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any, Callable

from benchmarks.common import (emit, failed_row, one_line, package_versions, row, settle_disk, time_loader, touch_count,
                               touched_bytes)

WORKERS = 2
BATCH = 256


def load_config() -> dict[str, Any]:
    with open(sys.argv[1]) as f:
        return json.load(f)


def list_images(images_dir: str) -> list[tuple[str, int]]:
    """Sorted (path, label) pairs of an ImageFolder: labels from sorted class folders."""
    root = Path(images_dir)
    classes = sorted(p.name for p in root.iterdir() if p.is_dir())
    out: list[tuple[str, int]] = []
    for label, cls in enumerate(classes):
        out.extend((str(p), label) for p in sorted((root / cls).glob("*.jpg")))
    return out


class Crop:
    """shardkit.CenterCrop(224) semantics on a ``{"jpg": bytes, ...}`` sample; picklable."""

    def __init__(self) -> None:
        from shardkit.batch.codecs import CenterCrop

        self.crop = CenterCrop(224, field="jpg")

    def __call__(self, sample: dict[str, Any]) -> dict[str, Any]:
        out = self.crop({"jpg": bytes(sample["jpg"])})
        return {"jpg": out["jpg"], "cls": int(sample["cls"])}


def loader(ds: Any, **kw: Any) -> Any:
    from torch.utils.data import DataLoader

    kw.setdefault("batch_size", BATCH)
    return DataLoader(ds, num_workers=WORKERS, **kw)


WARM_EPOCHS = 3  # warm rows: the best of this many epochs, as the cat ceiling is the best of 3 passes


def epoch_row(name: str, group: str, tool: str, make: Callable[[], Any], nbytes: int, expect: int | None = None,
              epochs: int | None = None, **extra: Any) -> dict[str, Any]:
    """Time ``epochs`` epochs of ``make()`` (default: WARM_EPOCHS for a warm row, else 1; each a
    new loader) and report the fastest, listing all. A short epoch is reported as failed, never
    as fast; a short repeat ends the repeats (the epochs before it still count, and it is noted).
    """
    runs: list[tuple[float, int, int]] = []
    for _ in range(epochs or (WARM_EPOCHS if group == "warm" else 1)):
        settle_disk()
        touched_bytes(reset=True)
        seconds, n = time_loader(make(), touch_count)  # every row reads every payload byte it receives
        runs.append((seconds, n, touched_bytes(reset=True)))
        if expect is not None and n != expect:
            break
    good = [r for r in runs if expect is None or r[1] == expect]
    if len(runs) > 1:
        extra["epoch_seconds"] = [round(r[0], 4) for r in runs]
    if not good:
        seconds, n, touched = runs[0]
        return failed_row(name, group, tool, f"epoch gave {n} samples, expected {expect}", samples=n,
                          seconds=round(seconds, 3), touched_bytes=touched, **extra)
    if len(good) < len(runs):
        extra["short_repeat"] = f"epoch {len(runs)} gave {runs[-1][1]} samples; best of the {len(good)} before it"
    seconds, n, touched = min(good)
    return row(name, group, tool, samples=n, seconds=seconds, nbytes=nbytes, touched_bytes=touched, **extra)


def guarded(rows: list[dict[str, Any]], name: str, group: str, tool: str, fn: Callable[[], dict[str, Any]],
            kind: str = "loader") -> dict[str, Any]:
    try:
        r = fn()
    except Exception as exc:  # noqa: BLE001 - one row's failure is that row's result
        traceback.print_exc(file=sys.stderr)
        r = failed_row(name, group, tool, f"{type(exc).__name__}: {exc}", kind=kind)
    rows.append(r)
    return r


def finish(rows: list[dict[str, Any]], packages: list[str]) -> None:
    emit({"rows": rows, "versions": package_versions(packages), "python": sys.version.split()[0],
          "executable": sys.executable})


def quiet_env() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("DO_NOT_TRACK", "1")


__all__ = ["BATCH", "WORKERS", "Crop", "epoch_row", "failed_row", "finish", "guarded", "list_images", "load_config",
           "loader", "one_line", "row"]
