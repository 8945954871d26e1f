"""What every matrix row measures the same way, for shardkit and the peers alike: an epoch
(samples/s, payload MB/s, seconds to the first batch) and the peak memory of the row's
processes (the loading process and each DataLoader worker).

Imported in both venvs (the peers' too): numpy, the standard library and benchmarks.common.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Callable, Iterable

from benchmarks.common import settle_disk, touch_count, touched_bytes

__all__ = ["REPEAT_UNDER_S", "RssSampler", "timed_epoch", "phase", "measured_row"]


def _status_kb(pid: int, names: tuple[str, ...]) -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key = line.split(":", 1)[0]
                if key in names:
                    out[key] = int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return out


def _descendants(pid: int) -> list[int]:
    out: list[int] = []
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            tids = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{p}/task/{tid}/children") as f:
                    kids = [int(x) for x in f.read().split()]
            except (OSError, ValueError):
                continue
            out.extend(kids)
            todo.extend(kids)
    return out


class RssSampler:
    """Peak memory of this process and of every process it starts, sampled every ``interval``.

    ``VmHWM`` (the kernel's own peak resident set) is read for each process until it exits;
    ``RssAnon`` (private memory: heaps, buffers; not the page cache of mapped files, which a
    zero-copy reader's RSS also counts) is sampled, so its peak may miss a spike shorter than
    the interval. Every process starts with the pages of the process it was forked from
    (torch and the loader library imported: ``base_*``).
    """

    _NAMES = ("VmHWM", "VmRSS", "RssAnon")

    def __init__(self, interval: float = 0.05) -> None:
        self.interval = interval
        self.pid = os.getpid()
        self.peaks: dict[int, dict[str, int]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self.base = _status_kb(self.pid, self._NAMES)

    def _sample(self) -> None:
        for pid in [self.pid, *_descendants(self.pid)]:
            now = _status_kb(pid, self._NAMES)
            if now:
                peak = self.peaks.setdefault(pid, {})
                for k, v in now.items():
                    peak[k] = max(peak.get(k, 0), v)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def summary(self) -> dict[str, Any]:
        """Peaks in MB: ``main_*`` this process, ``worker_*`` the largest of the others."""
        mb = 1 / 1024
        main = self.peaks.get(self.pid, {})
        others = [v for pid, v in self.peaks.items() if pid != self.pid]
        return {"main_hwm_mb": round(main.get("VmHWM", 0) * mb), "main_anon_mb": round(main.get("RssAnon", 0) * mb),
                "worker_hwm_mb": round(max((o.get("VmHWM", 0) for o in others), default=0) * mb) or None,
                "worker_anon_mb": round(max((o.get("RssAnon", 0) for o in others), default=0) * mb) or None,
                "processes": 1 + len(others),
                "base_rss_mb": round(self.base.get("VmRSS", 0) * mb), "base_anon_mb": round(self.base.get("RssAnon", 0) * mb)}


def timed_epoch(loader: Iterable[Any], count: Callable[[Any], int] = touch_count) -> dict[str, Any]:
    """One epoch of ``loader``, every payload byte read by the consumer (``touch_count``).

    The clock starts at ``iter(loader)`` (workers start, first requests) and the first batch
    is timed on arrival, before the consumer reads it.

    Returns:
        ``seconds``, ``samples``, ``first_batch_s`` and ``touched`` (payload bytes read).
    """
    settle_disk()
    touched_bytes(reset=True)
    n = 0
    first = None
    t0 = time.perf_counter()
    for batch in loader:
        if first is None:
            first = time.perf_counter() - t0
        n += count(batch)
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "samples": n, "first_batch_s": first, "touched": touched_bytes(reset=True)}


REPEAT_UNDER_S = 10.0
"""A phase repeats its epoch (up to ``epochs``) only while the epochs take less than this: a
short epoch is at the mercy of a busy second of the machine, a long one averages it out, and
a repeat of a minute-long per-sample peer epoch would cost the run minutes for nothing."""


def phase(make: Callable[[], Iterable[Any]], epochs: int, expect: int, payload: int) -> dict[str, Any]:
    """The best of up to ``epochs`` epochs, a new loader from ``make()`` each (made before the
    clock); no repeat after an epoch of :data:`REPEAT_UNDER_S` or more (the same rule for every
    tool).

    An epoch that gives other than ``expect`` samples fails the phase (a short epoch is never
    reported as fast); the repeats stop there.

    Returns:
        ``status``, ``samples_per_s``, ``mb_per_s`` (payload), ``seconds``, ``first_batch_s``
        (of the best epoch; ``first_batch_first_s`` of the first), ``epoch_seconds``.
    """
    runs = []
    for _ in range(max(1, epochs)):
        runs.append(timed_epoch(make()))
        if runs[-1]["samples"] != expect:
            r = runs[-1]
            return {"status": "failed", "reason": f"epoch gave {r['samples']} samples, expected {expect}",
                    "epoch_seconds": [round(x["seconds"], 3) for x in runs]}
        if runs[-1]["seconds"] >= REPEAT_UNDER_S:
            break
    best = min(runs, key=lambda r: r["seconds"])
    s = best["seconds"]
    return {"status": "ok", "seconds": round(s, 4), "samples": expect, "samples_per_s": round(expect / s, 1),
            "mb_per_s": round(payload / s / 1e6, 1), "first_batch_s": round(best["first_batch_s"] or 0, 4),
            "first_batch_first_s": round(runs[0]["first_batch_s"] or 0, 4),
            "epoch_seconds": [round(x["seconds"], 3) for x in runs], "touched": best["touched"]}


def measured_row(fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``fn()``'s result plus ``rss``: the peaks of this process and its workers while it ran."""
    with RssSampler() as rss:
        out = fn()
    out["rss"] = rss.summary()
    return out
