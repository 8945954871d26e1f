"""Shared benchmark helpers: a throwaway SeaweedFS, timing, machine facts, result writers.

Every function here stands alone (other ``bench_*.py`` scripts import what they need), and
none of it is imported by ``shardkit`` itself. Secrets never reach stdout, JSON or charts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import platform
import sys
import textwrap
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

from shardkit.dev import devserver

REPO_ROOT = Path(__file__).resolve().parent.parent
BENCH_DIR = REPO_ROOT / "benchmarks"


# --------------------------------------------------------------------------- SeaweedFS

# The launcher lives in shardkit.dev.devserver (shared with tests/conftest.py); re-exported here.
free_port_pairs = devserver.free_port_pairs
weed_binary = devserver.weed_binary


@dataclasses.dataclass(frozen=True)
class S3Server(devserver.S3Server):
    """A running S3 endpoint (``repr`` hides the secret)."""

    def env(self) -> dict[str, str]:
        """Standard variables for boto3/s3fs, plus the names MosaicML Streaming reads."""
        return {**super().env(), "AWS_DEFAULT_REGION": devserver.REGION, "S3_ENDPOINT_URL": self.endpoint}


class Weed(devserver.DevServer):
    """``weed mini`` on free loopback ports with random keys, in a throwaway directory.

    Use as a context manager; stopped by its PID (never by name) and its directory removed.
    """

    server_type = S3Server

    def __init__(self, timeout: float = 30.0) -> None:
        super().__init__(timeout=timeout, key_prefix="bk")


def bench_images(count: int) -> Path:
    """``count`` sample JPEGs (shardkit.dev.sampledata), made once in the temp dir and kept for
    later runs of any benchmark asking for as many."""
    import tempfile

    from shardkit.dev.sampledata import make_image_folder

    return make_image_folder(Path(tempfile.gettempdir()) / f"shardkit-bench-images-{count}", count)


def add_pin_server_flag(ap: Any) -> None:
    """``--pin-server`` on an argparse parser (see :func:`pin_server_apart`)."""
    ap.add_argument("--pin-server", action="store_true",
                    help="SeaweedFS on one CPU, this benchmark on the others (common.pin_server_apart)")


@contextlib.contextmanager
def packed_on_weed(folder: Path, shard_bytes: str = "64MB",
                   pin_server: bool = False) -> Iterator[tuple[devserver.S3Server, Any, str]]:
    """A throwaway SeaweedFS (the AWS_* variables of this process point at it) with ``folder``
    packed by shardkit into ``s3://bench/ds``; yields (server, boto3 client, dataset URL).
    ``pin_server``: after the pack, :func:`pin_server_apart` for the rest of the run."""
    import shardkit

    with Weed() as server:
        os.environ.update(server.env())
        client = boto3_client(server.env())
        client.create_bucket(Bucket="bench")
        url = "s3://bench/ds"
        shardkit.pack(str(folder), url, shard_bytes=shard_bytes, progress=False)
        if pin_server:
            pin_server_apart(server.pid)
        yield server, client, url


def boto3_client(server_env: dict[str, str] | None = None, max_pool: int = 16) -> Any:
    """A boto3 S3 client for the endpoint in ``server_env`` (default: the environment)."""
    import boto3
    from botocore.config import Config

    env = server_env or os.environ
    return boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"], region_name="us-east-1",
                        config=Config(max_pool_connections=max_pool, retries={"max_attempts": 3}))


# --------------------------------------------------------------------------- timing


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def batch_len(batch: Any) -> int:
    """Samples in one DataLoader batch (dict of lists/tensors, list, or tensor)."""
    if isinstance(batch, dict):
        for key in ("__key__", "__index__"):
            if key in batch:
                return len(batch[key])
        return len(next(iter(batch.values())))
    if isinstance(batch, (list, tuple)):
        first = batch[0]
        return len(first) if hasattr(first, "__len__") and not isinstance(first, (bytes, str)) else len(batch)
    return len(batch)


def settle_disk() -> None:
    """Write back what earlier rows left dirty in the page cache, before the clock starts.

    Every row that fills a cache writes ~1.3 GB; on this VM the kernel throttles writers to
    the disk's writeback pace once ~2 GB is dirty, so without this a row would pay for the
    rows before it (measured: a cold fill at ~300 instead of ~650 MB/s).
    """
    os.sync()


def pin_server_apart(server_pid: int) -> None:
    """Give the S3 server the first CPU and this process (and every thread or process it starts
    from now on) the others, as if the storage ran on a machine of its own.

    On the 2-core benchmark box the server and the loader otherwise share both cores, and the
    GETs alone keep them busy: every CPU second a loader spends beyond the GETs (verifying,
    writing the cache, batching, the consumer) is then taken from the server, and a ratio to
    the GET ceiling measures total CPU rather than whether the loader keeps up with the store.
    ``--pin-server`` runs measure the second; both are reported (RESULTS.md)."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SystemExit(f"--pin-server needs 2 CPUs or more, this process has {len(cpus)}")
    for pid, mask in ((server_pid, set(cpus[:1])), (os.getpid(), set(cpus[1:]))):
        for tid in os.listdir(f"/proc/{pid}/task"):  # threads made later inherit their maker's mask
            with contextlib.suppress(ProcessLookupError):
                os.sched_setaffinity(int(tid), mask)


def drop_cache(cache: Path) -> None:
    """Delete a row's node cache, and let go of this process's kept maps (zero-copy) of its
    files: a kept map holds its deleted file until the next shard open prunes it, which would
    free ~1.3 GB inside the next row's clock. So the next row's cold fill pays for neither."""
    import shutil

    from shardkit.cache.kept_maps import KEPT

    shutil.rmtree(cache)
    KEPT.clear()


def get_range_into(client: Any, bucket: str, job: tuple[str, int, int], dest: Mapping[str, Any]) -> int:
    """GET the ``(key, lo, hi)`` byte range of ``bucket`` into ``dest[key][lo:hi]``; a range the
    server ends early raises OSError. The leanest read boto3 allows: ``readinto`` of
    http.client's response, socket -> ``dest`` (urllib3's ``readinto`` reads into new bytes,
    then copies them: ~0.1 s more client CPU per 1.27 GB here), the read shardkit's own boto3
    transport makes."""
    key, lo, hi = job
    raw = client.get_object(Bucket=bucket, Key=key, Range=f"bytes={lo}-{hi - 1}")["Body"]._raw_stream
    readinto = getattr(getattr(raw, "_fp", None), "readinto", raw.readinto)
    view = memoryview(dest[key])[lo:hi]
    while view.nbytes:
        got = readinto(view)
        if not got:
            raise OSError(f"s3://{bucket}/{key}: the server ended the range {lo}-{hi} early")
        view = view[got:]
    raw.release_conn()
    return hi - lo


def ranged_get_into(client: Any, bucket: str, jobs: Sequence[tuple[str, int, int]], dest: Mapping[str, Any],
                    threads: int = 8) -> int:
    """:func:`get_range_into` for every job, ``threads`` at a time; returns the bytes moved.
    The GET ceilings of the benchmarks."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(threads) as pool:
        return sum(pool.map(lambda job: get_range_into(client, bucket, job, dest), jobs))


def get_and_finish(client: Any, bucket: str, objects: Sequence[tuple[str, int]], dest: Mapping[str, Any],
                   into: Path, part: int, batch_bytes: int = 16 << 20) -> None:
    """The GETs of :func:`ranged_get_into` plus the least any verified, caching batch loader adds
    to each object once all of it has landed (2 threads, as shardkit's 2 read threads): xxh3
    over it, its write to a new file in ``into`` with shardkit's ``O_DIRECT`` writer, a copy into
    a reused batch-sized buffer, and the consumer's read of every cache line of the copy
    (:func:`touch_count`'s).

    ``dest`` holds a :class:`shardkit.cache.landing.Landing` per key (page-aligned, touched by the
    caller before the clock). A floor for a cold epoch, not a ceiling: nothing here parses a
    tar or makes a batch."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np
    import xxhash

    from shardkit.cache.landing import DirectWriter

    into.mkdir(parents=True, exist_ok=True)
    left = {key: -(-size // part) for key, size in objects}
    sizes = dict(objects)
    maps = {key: buf.map for key, buf in dest.items()}
    mu = threading.Lock()
    batches = threading.local()

    def finish(key: str) -> None:
        size, buf = sizes[key], dest[key]
        xxhash.xxh3_128_hexdigest(memoryview(buf.map)[:size])
        path = into / key.replace("/", "_")
        path.touch()
        writer = DirectWriter(str(path), buf)
        for lo in range(0, size, part):
            writer.write(lo, min(size, lo + part))
        writer.finish(size)
        if not hasattr(batches, "out"):
            batches.out = np.empty(batch_bytes, np.uint8)
        src = np.frombuffer(buf.map, np.uint8, size)
        for lo in range(0, size, batch_bytes):
            chunk = batches.out[:min(batch_bytes, size - lo)]
            np.copyto(chunk, src[lo:lo + chunk.nbytes])
            _touched[1] += int(chunk[::TOUCH_STRIDE].sum())

    with ThreadPoolExecutor(2) as finishers:
        done: list[Any] = []

        def landed(job: tuple[str, int, int]) -> None:
            get_range_into(client, bucket, job, maps)
            with mu:
                left[job[0]] -= 1
                if left[job[0]] == 0:
                    done.append(finishers.submit(finish, job[0]))

        with ThreadPoolExecutor(8) as getters:
            list(getters.map(landed, part_jobs(objects, part)))
        for fut in done:
            fut.result()


def floor_buffers(objects: Sequence[tuple[str, int]]) -> dict[str, Any]:
    """A landing buffer per object for :func:`get_and_finish`, every page touched now (before
    the clock, as the GET ceiling's buffers are)."""
    from shardkit.cache.landing import Landing

    bufs = {key: Landing(-(-size // 4096) * 4096) for key, size in objects}
    for buf in bufs.values():
        buf.map.write(bytes(buf.capacity))
    return bufs


CEILING_PARTS = (8 << 20, 16 << 20, 32 << 20)
"""Part sizes a GET ceiling tries. Client CPU falls with bigger parts (each boto3 request costs
~1.7 ms of it here: 0.70 / 0.56 / 0.46 s per 1.27 GB at 8 / 16 / 32 MiB) and 64 MiB parts
(one per shard) leave threads idle; the fastest differs from run to run, so all are tried."""


def get_ceiling(client: Any, bucket: str, objects: Sequence[tuple[str, int]], dest: Mapping[str, Any],
                passes: int = 3) -> tuple[float, int]:
    """The GET ceiling of ``objects``: the best of ``passes`` passes of :func:`ranged_get_into`
    at each of :data:`CEILING_PARTS`, into ``dest`` (allocated by the caller, before the clock).
    Conservative (high), like the ``cat`` ceiling. Returns (seconds, part size of the best)."""
    total = sum(size for _, size in objects)
    best = (float("inf"), 0)
    for _ in range(passes):  # interleaved, so that a slow phase of the machine hits every size
        for part in CEILING_PARTS:
            jobs = part_jobs(objects, part)
            t0 = time.perf_counter()
            got = ranged_get_into(client, bucket, jobs, dest)
            best = min(best, (time.perf_counter() - t0, part))
            if got != total:
                raise OSError(f"read {got} of {total} bytes")
    return best


def part_jobs(objects: Iterable[tuple[str, int]], part: int) -> list[tuple[str, int, int]]:
    """``(key, lo, hi)`` ranges of at most ``part`` bytes covering every ``(key, size)``."""
    return [(key, lo, min(size, lo + part)) for key, size in objects for lo in range(0, size, part)]


def new_file_maps(into: Path, objects: Iterable[tuple[str, int]]) -> dict[str, Any]:
    """A writable map of a new ``size``-byte file in ``into`` per ``(key, size)``, by key."""
    import mmap

    into.mkdir()
    maps = {}
    for key, size in objects:
        with open(into / key.replace("/", "_"), "w+b") as f:
            f.truncate(size)
            maps[key] = mmap.mmap(f.fileno(), size)
    return maps


def time_loader(loader: Iterable[Any], count: Callable[[Any], int] = batch_len) -> tuple[float, int]:
    """Iterate ``loader`` once; return (seconds, samples)."""
    t0 = time.perf_counter()
    n = 0
    for batch in loader:
        n += count(batch)
    return time.perf_counter() - t0, n


TOUCH_STRIDE = 64  # one byte per cache line: every line of the payload is read from memory
_touched = [0, 0]  # [payload bytes seen, running checksum] (the sum keeps the reads from being skipped)


def _flat_bytes(v: Any) -> Any:
    """``v`` as a flat uint8 array without a copy (bytes-likes, contiguous arrays), else None."""
    import numpy as np

    if isinstance(v, (bytes, bytearray, memoryview)):
        return np.frombuffer(v, dtype=np.uint8)
    if isinstance(v, np.ndarray) and v.dtype != object and v.flags.c_contiguous:
        if v.dtype == np.uint8 and v.ndim == 1:  # per-sample buffers: skip two calls per member
            return v
        return v.reshape(-1).view(np.uint8)
    return None


def _touch(v: Any) -> int:
    """Read every cache line of ``v``'s payload (strided uint8 sum); returns its size in bytes."""
    import numpy as np

    if hasattr(v, "numpy") and not isinstance(v, np.ndarray):  # torch tensor: zero-copy view
        v = v.numpy()
    if isinstance(v, np.ndarray) and v.dtype == object:
        return sum(_touch(x) for x in v.reshape(-1))
    flat = _flat_bytes(np.ascontiguousarray(v) if isinstance(v, np.ndarray) else v)
    if flat is not None:
        _touched[1] += int(flat[::TOUCH_STRIDE].sum())
        return int(flat.nbytes)
    if isinstance(v, (list, tuple)):
        flat_parts = [_flat_bytes(x) for x in v]
        if v and all(p is not None for p in flat_parts):
            # One numpy pass per list (the strided views of every member, joined): the same
            # cache lines as member by member, without ~5 us of Python per member.
            parts = [p for p in flat_parts if p is not None]
            _touched[1] += int(np.concatenate([p[::TOUCH_STRIDE] for p in parts]).sum())
            return sum(p.nbytes for p in parts)
        return sum(_touch(x) for x in v)
    if isinstance(v, dict):
        return sum(_touch(x) for k, x in v.items()
                   if not (isinstance(k, str) and (k.startswith("__") or k.endswith(".offsets"))))
    return 0  # str keys, ints, None


def touch_count(batch: Any) -> int:
    """The consumer every loader row uses: read the payload of every sample in ``batch`` (one
    byte per 64, so every cache line), then count its samples. Whatever the batch's shape
    (contiguous uint8 + offsets, list of ``bytes``, stacked tensors), the same bytes are read."""
    _touched[0] += _touch(batch)
    return batch_len(batch)


def touched_bytes(reset: bool = False) -> int:
    n = _touched[0]
    if reset:
        _touched[0] = 0
    return n


def row(name: str, group: str, tool: str, *, samples: int = 0, seconds: float = 0.0, nbytes: int = 0,
        status: str = "ok", reason: str = "", kind: str = "loader", **extra: Any) -> dict[str, Any]:
    """One result row with derived rates. ``kind``: loader, ceiling or pack."""
    ok = status == "ok" and seconds > 0
    out = {"name": name, "group": group, "tool": tool, "kind": kind, "status": status, "reason": reason,
           "samples": int(samples), "bytes": int(nbytes), "seconds": round(seconds, 4) if seconds else None,
           "samples_per_s": round(samples / seconds, 1) if ok and samples else None,
           "mb_per_s": round(nbytes / seconds / 1e6, 1) if ok and nbytes else None}
    out.update(extra)
    return out


def failed_row(name: str, group: str, tool: str, reason: str, status: str = "failed", **extra: Any) -> dict[str, Any]:
    return row(name, group, tool, status=status, reason=one_line(reason), **extra)


def one_line(text: str, limit: int = 240) -> str:
    lines = [ln.strip() for ln in str(text).strip().splitlines() if ln.strip()]
    line = lines[-1] if lines else "no output"
    return line if len(line) <= limit else line[: limit - 3] + "..."


def run_guarded(name: str, group: str, tool: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Run one row; an exception becomes a failed row with its one-line reason."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - a benchmark row must never take the run down
        return failed_row(name, group, tool, f"{type(exc).__name__}: {exc}")


def emit(payload: dict[str, Any]) -> None:
    """A peer script's result: one JSON document on stdout between markers."""
    sys.stdout.write("\n@@BENCH-JSON@@\n" + json.dumps(payload) + "\n@@END@@\n")
    sys.stdout.flush()


def parse_emitted(stdout: str) -> dict[str, Any] | None:
    start = stdout.rfind("@@BENCH-JSON@@")
    if start < 0:
        return None
    body = stdout[start + len("@@BENCH-JSON@@"):]
    end = body.find("@@END@@")
    try:
        return json.loads(body[:end] if end >= 0 else body)
    except ValueError:
        return None


def drop_page_cache_for(paths: Iterable[Path]) -> None:
    """Best effort: evict files from the page cache (posix_fadvise DONTNEED) for a cold-disk row."""
    for p in paths:
        try:
            fd = os.open(p, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except (OSError, AttributeError):
            pass
        finally:
            os.close(fd)


# --------------------------------------------------------------------------- machine facts


def machine_facts() -> dict[str, Any]:
    mem = 0
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    mem = int(line.split()[1]) * 1024
    except OSError:
        pass
    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        pass
    return {"cpu_count": os.cpu_count(), "cpu_model": cpu, "memory_bytes": mem,
            "memory_gib": round(mem / 2**30, 1), "platform": platform.platform(),
            "python": platform.python_version()}


def package_versions(names: Iterable[str]) -> dict[str, str | None]:
    from importlib import metadata

    out: dict[str, str | None] = {}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


# --------------------------------------------------------------------------- writers


def fmt_rate(v: float) -> str:
    return f"{v:,.0f}" if v >= 10 else f"{v:.2f}"


def format_table(rows: list[dict[str, Any]]) -> str:
    head = f"{'group':8s} {'row':46s} {'samples/s':>10s} {'MB/s':>8s} {'seconds':>8s}  status"
    lines = [head, "-" * len(head)]
    for r in rows:
        sps = fmt_rate(r["samples_per_s"]) if r.get("samples_per_s") else "-"
        mbs = f"{r['mb_per_s']:,.0f}" if r.get("mb_per_s") else "-"
        sec = f"{r['seconds']:.2f}" if r.get("seconds") else "-"
        status = r["status"] if r["status"] == "ok" else f"{r['status']}: {r.get('reason', '')}"
        lines.append(f"{r['group']:8s} {r['name'][:46]:46s} {sps:>10s} {mbs:>8s} {sec:>8s}  {status}")
    return "\n".join(lines)


def write_json(path: Path, payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2, sort_keys=False) + "\n")
    os.replace(tmp, path)


GROUP_TITLES = {
    "cold": "Raw bytes, cold (from S3, empty local cache)",
    "warm": "Raw bytes, warm (local cache / local disk)",
    "decoded": "Decoded: PIL/cv2 decode + centre crop 224 -> uint8 tensor",
    "large": "Large samples (~300 MB arrays), one process, whole-sample reads",
}


def write_chart(path: Path, rows: list[dict[str, Any]], title: str, ratios: dict[str, str] | None = None,
                groups: tuple[str, ...] = ("cold", "warm", "decoded")) -> None:
    """Horizontal bars of samples/s per row, one panel per group, shardkit in red.

    Each panel is scaled to its loaders; a ceiling far beyond them is drawn clipped (hatched)
    with its real value written on it, so the loaders stay comparable. Failed rows say why.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    panels = [(g, [r for r in rows if r["group"] == g and r.get("kind") != "pack"]) for g in groups]
    panels = [(g, rs) for g, rs in panels if rs] or [("none", [])]
    heights = [max(1.2, 0.34 * len(rs) + 0.9) for _, rs in panels]
    fig, axes = plt.subplots(len(panels), 1, figsize=(10.5, sum(heights) + 1.35),
                             gridspec_kw={"height_ratios": heights}, squeeze=False)
    red, blue, grey = "#d62728", "#1f77b4", "#8c8c8c"
    for ax, (group, rs) in zip(axes[:, 0], panels):
        vals = [r.get("samples_per_s") or 0.0 for r in rs]
        loaders = [v for r, v in zip(rs, vals) if r.get("kind") != "ceiling"]
        top = max(loaders or vals or [1.0]) or 1.0
        ceils = [v for r, v in zip(rs, vals) if r.get("kind") == "ceiling" and v <= top * 2.5]
        xmax = max([top * 1.45] + [c * 1.3 for c in ceils])  # a near ceiling is drawn to scale
        ys = list(range(len(rs)))[::-1]
        for y, r, v in zip(ys, rs, vals):
            ceiling = r.get("kind") == "ceiling"
            color = grey if ceiling else (red if r["tool"] == "shardkit" else blue)
            shown = min(v, xmax * 0.8) if ceiling else v
            ax.barh(y, shown, color=color, height=0.7, hatch="//" if ceiling and v > shown else None,
                    edgecolor="white" if ceiling else None)
            if r["status"] != "ok" or not v:
                label = r["status"].upper() + (f": {r.get('reason', '')[:70]}" if r.get("reason") else "")
                ax.text(xmax * 0.01, y, label, va="center", fontsize=7.5, color="#b00000")
            elif ceiling and v > shown:
                ax.text(shown * 0.98, y, f"{v:,.0f}/s (off scale)", va="center", ha="right", fontsize=8,
                        bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.85, "pad": 1.5})
            else:
                ax.text(shown + xmax * 0.01, y, f"{fmt_rate(v)}/s" + (f"  ({r['mb_per_s']:,.0f} MB/s)" if group == "large"
                        and r.get("mb_per_s") else ""), va="center", fontsize=8)
        ax.set_yticks(ys)
        ax.set_yticklabels([textwrap.fill(r["name"], 50) for r in rs], fontsize=8.5)  # long names: 2 lines
        ax.set_xlim(0, xmax)
        sub = GROUP_TITLES.get(group, group)
        if ratios and ratios.get(group):
            sub += f"\n{ratios[group]}"
        ax.set_title(sub, fontsize=9.5, loc="left")
        ax.tick_params(axis="x", labelsize=8)
        ax.grid(axis="x", alpha=0.3)
    axes[-1, 0].set_xlabel("samples per second (higher is better); ceilings as sample-equivalents", fontsize=9)
    fig.legend(handles=[Patch(color=red, label="shardkit"), Patch(color=blue, label="peers and baselines"),
                        Patch(color=grey, label="ceiling (same bytes, no loader)")],
               loc="upper right", fontsize=8, ncol=3, frameon=False, bbox_to_anchor=(0.99, 0.985))
    fig.suptitle(title, fontsize=10, x=0.01, ha="left", y=0.995)
    fig.subplots_adjust(left=0.36, right=0.98, top=1 - 1.0 / (sum(heights) + 1.1), bottom=0.5 / (sum(heights) + 1.1),
                        hspace=0.55)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=72)
    plt.close(fig)
