"""``where=`` on a large manifest: the time and peak RSS of one rank's selection, against
pyarrow.compute reading the same columns and filtering them.

    .venv/bin/python -m benchmarks.bench_where [--rows 20000000] [--where "label < 500 AND width >= 224"] [--s3]

Builds once, under benchmarks/.cache/where-<rows>, a synthetic committed manifest (no shards:
the selection reads only the manifest): ``dataset.json``, ``shards.parquet`` with 10,000
samples per shard and one samples fragment per 1 M rows (a row group per shard), with the v1
columns (``key``, ``shard``, ``offset``, ``size``, ``checksum``; ``fields`` and
``block_checksums`` null) and metadata ``label`` (0..999), ``width`` (32..1023) and ``score``
(float). Each measurement runs in a fresh process, which reports its wall time and
``ru_maxrss``:

* ``shardkit cold``: :func:`shardkit.read.selection.select` with an empty node copies
  directory (it copies the fragments first, as the first rank of a node does);
* ``shardkit warm``: the same with the copies present (another job on the node, or a rank
  whose node already holds them);
* ``shardkit stored``: a rank loading the node's stored result (every rank but the first);
* ``pyarrow``: ``pq.read_table(columns=...)`` of the query's columns and ``pc`` filter.

With ``--s3`` the shardkit arms read the manifest from a throwaway SeaweedFS on loopback (the
files uploaded there first, untimed), as a node of a training job reads it from its bucket.

``--phases N`` instead times the node's first rank N times each way, alternating, in one
process against one store: ``overlapped`` (:func:`shardkit.read.where.where_indices` on an
empty copies directory: each fragment queried as it lands) and ``fetch, then query`` (every
fragment copied first, then one DuckDB scan of them all: what the first rank did before). Each
run reports its total and the time after the last fragment landed (the newest copy's mtime).
Writes results/where_phases.json.

Peak RSS is /proc's VmHWM of the measuring process (imports included).

Writes results/where.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PER_SHARD = 10_000
PER_FRAGMENT = 1_000_000
CACHE = Path(__file__).resolve().parent / ".cache"


def build(rows: int) -> Path:
    """The synthetic dataset of ``rows`` samples (made once, kept under benchmarks/.cache)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from shardkit.format.manifest import SAMPLE_COLUMNS, dataset_info, dataset_json_bytes, shards_table, shards_table_bytes
    from shardkit.format.rows import ShardRecord

    root = CACHE / f"where-{rows}"
    if (root / "dataset.json").exists():
        return root
    tmp = root.with_suffix(".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "manifest").mkdir(parents=True)
    rng = np.random.default_rng(0)
    records, files, groups = [], [], []
    for f, lo in enumerate(range(0, rows, PER_FRAGMENT)):
        hi = min(rows, lo + PER_FRAGMENT)
        n = hi - lo
        idx = np.arange(lo, hi)
        shard = (idx // PER_SHARD).astype(np.int32)
        size = rng.integers(20_000, 200_000, n)
        # Offsets within each shard: the running sum of the sizes before (plus a tar header each).
        offset = np.zeros(n, np.int64)
        starts = np.flatnonzero(np.r_[True, shard[1:] != shard[:-1]])
        csum = np.cumsum(size + 512) - (size + 512)
        offset = csum - np.repeat(csum[starts], np.diff(np.r_[starts, n])) + 512
        keys = pa.array([f"s{i:010d}" for i in range(lo, hi)], pa.string())
        table = pa.table({
            "key": keys, "shard": shard, "offset": offset, "size": size.astype(np.int64),
            "fields": pa.nulls(n, SAMPLE_COLUMNS.field("fields").type),
            "checksum": pa.array(rng.integers(0, 2**63, n).astype(np.uint64)),
            "block_checksums": pa.nulls(n, SAMPLE_COLUMNS.field("block_checksums").type),
            "label": rng.integers(0, 1000, n), "width": rng.integers(32, 1024, n),
            "score": rng.random(n) * 10,
        })
        name = f"manifest/samples-{f:05d}.parquet"
        pq.write_table(table, tmp / name, row_group_size=PER_SHARD, compression="zstd")
        for g, s in enumerate(range(int(shard[0]), int(shard[-1]) + 1)):
            count = int(np.count_nonzero(shard == s))
            total = int((size[shard == s] + 512).sum())
            records.append(ShardRecord(s, f"shards/shard-{s:06d}.tar", count, total, f"{s:032x}"))
            files.append(name)
            groups.append(g)
        print(f"built {hi:,} rows", file=sys.stderr)
    shards = shards_table(records, files, groups)
    (tmp / "manifest/shards.parquet").write_bytes(shards_table_bytes(shards))
    info = dataset_info(shards, ["bin"], {"type": "synthetic"}, None, [])
    (tmp / "dataset.json").write_bytes(dataset_json_bytes(info))
    tmp.rename(root)
    return root


def _peak_rss() -> int:
    """This process's peak RSS in bytes: /proc's VmHWM (ru_maxrss would carry the parent's
    peak across fork and exec, and the parent built the manifest)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def measure(arm: str, url: str, where: str, copies: str) -> dict[str, Any]:
    """One arm, in this process: its wall time (modules imported before the clock starts),
    peak RSS (imports included) and selected count."""
    import duckdb  # noqa: F401 - imported before timing, in both arms alike
    import numpy  # noqa: F401
    import pyarrow.compute  # noqa: F401
    import pyarrow.parquet  # noqa: F401

    import shardkit.read.selection  # noqa: F401
    import shardkit.read.where  # noqa: F401

    rss0 = _peak_rss()
    opened = 0.0
    t0 = time.perf_counter()
    if arm == "pyarrow":
        import numpy as np
        import pyarrow.compute as pc
        import pyarrow.parquet as pq

        if where != "label < 500 AND width >= 224":
            raise SystemExit("the pyarrow arm implements only the default query")
        # The fragments in name order are the global order: the mask's positions are the indices.
        files = sorted(str(p) for p in Path(url, "manifest").glob("samples-*.parquet"))
        table = pq.read_table(files, columns=["label", "width"], use_threads=True)
        mask = pc.and_(pc.less(table["label"], 500), pc.greater_equal(table["width"], 224))
        count = int(np.flatnonzero(mask.to_numpy(zero_copy_only=False)).size)
    else:
        from shardkit.read.dataset import Dataset
        from shardkit.read.selection import select

        # Every reader opens the dataset anyway (dataset.json, shards.parquet): timed apart.
        ds = Dataset(url)
        ds.manifest_cache = copies
        opened = time.perf_counter() - t0
        t0 = time.perf_counter()
        sel = select(ds, where=where)
        assert sel is not None
        count = len(sel)
    seconds = time.perf_counter() - t0
    peak = _peak_rss()
    return {"arm": arm, "seconds": round(seconds, 3), "open_seconds": round(opened, 3), "peak_rss_mb": round(peak / 2**20, 1),
            "rss_after_imports_mb": round(rss0 / 2**20, 1), "selected": count}


def phases(url: str, where: str, runs: int) -> list[dict[str, Any]]:
    """The first rank's selection ``runs`` times each way, alternating (see the module doc)."""
    import numpy as np

    from shardkit.read.dataset import Dataset
    from shardkit.read.where import connect, local_fragments, where_indices

    def fetch_then_query(ds: Dataset) -> int:
        local_fragments(ds, ds.manifest_cache or "")
        sql = connect(ds)
        try:
            rows = sql.con.sql(sql.scan).filter(where).project("file_index, file_row_number").fetchnumpy()
            got = sql.global_indices(rows["file_index"], np.asarray(rows["file_row_number"], np.int64))
        finally:
            sql.close()
        return int(got.size)

    arms = {"overlapped": lambda ds: int(where_indices(ds, where).size), "fetch, then query": fetch_then_query}
    out = []
    for run in range(runs + 1):  # the first round warms imports and connections: not kept
        for name in (list(arms) if run % 2 else list(arms)[::-1]):
            copies = tempfile.mkdtemp(prefix="bench-where-phases-")
            try:
                ds = Dataset(url)
                ds.manifest_cache = copies
                t0 = time.time()
                count = arms[name](ds)
                t1 = time.time()
                landed = max(f.stat().st_mtime for f in Path(copies).glob("*.parquet"))
            finally:
                shutil.rmtree(copies, ignore_errors=True)
            row = {"arm": name, "seconds": round(t1 - t0, 3), "after_last_fetch": round(t1 - landed, 3),
                   "selected": count, "load": round(os.getloadavg()[0], 2)}
            if run:
                out.append(row)
            print(json.dumps(row), file=sys.stderr)
    return out


def _child(arm: str, url: str, where: str, copies: str) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-m", "benchmarks.bench_where", "--measure", arm, "--url", url,
                          "--where", where, "--copies", copies], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parent.parent)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=20_000_000)
    p.add_argument("--where", default="label < 500 AND width >= 224")
    p.add_argument("--measure", help=argparse.SUPPRESS)
    p.add_argument("--url", help=argparse.SUPPRESS)
    p.add_argument("--copies", help=argparse.SUPPRESS)
    p.add_argument("--s3", action="store_true", help="read the manifest from a throwaway SeaweedFS")
    p.add_argument("--phases", type=int, default=0, metavar="N",
                   help="time the first rank N times overlapped and N times fetch-then-query, alternating")
    args = p.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure, args.url, args.where, args.copies)))
        return
    t0 = time.perf_counter()
    root = build(args.rows)
    print(f"manifest of {args.rows:,} rows at {root} (built or found in {time.perf_counter() - t0:.1f}s)", file=sys.stderr)
    with contextlib.ExitStack() as stack:
        url = str(root)
        if args.s3:
            url = _upload(stack, root)
        if args.phases:
            runs = phases(url, args.where, args.phases)
            summary = {}
            for name in ("overlapped", "fetch, then query"):
                mine = sorted(runs, key=lambda r: r["seconds"])
                mine = [r for r in mine if r["arm"] == name]
                tails = sorted(r["after_last_fetch"] for r in mine)
                summary[name] = {"median_seconds": mine[len(mine) // 2]["seconds"],
                                 "median_after_last_fetch": tails[len(tails) // 2]}
            report = {"rows": args.rows, "where": args.where, "store": "s3" if args.s3 else "local files",
                      "runs": runs, "summary": summary}
            out = Path(__file__).resolve().parent / "results" / "where_phases.json"
            out.write_text(json.dumps(report, indent=2) + "\n")
            print(json.dumps(report["summary"], indent=2))
            return
        results = _arms(url, str(root), args.where)
    manifest_bytes = sum(f.stat().st_size for f in (root / "manifest").glob("samples-*.parquet"))
    report = {"rows": args.rows, "where": args.where, "store": "s3 (SeaweedFS, loopback)" if args.s3 else "local files",
              "manifest_bytes": manifest_bytes, "cpus": os.cpu_count(), "results": results}
    out = Path(__file__).resolve().parent / "results" / ("where_s3.json" if args.s3 else "where.json")
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


def _upload(stack: contextlib.ExitStack, root: Path) -> str:
    """Start a throwaway SeaweedFS (this process's AWS_* variables point at it, so the arms'
    processes reach it), upload the manifest under ``s3://where/ds`` and return that URL."""
    from benchmarks.common import Weed, boto3_client

    server = stack.enter_context(Weed())
    os.environ.update(server.env())
    client = boto3_client(server.env())
    client.create_bucket(Bucket="where")
    for f in sorted(root.rglob("*")):
        if f.is_file():
            client.upload_file(str(f), "where", f"ds/{f.relative_to(root)}")
    return "s3://where/ds"


def _arms(url: str, local_root: str, where: str) -> list[dict[str, Any]]:
    """Every arm, each in a fresh process: shardkit cold, warm and stored over ``url``, and
    pyarrow over the local files."""
    copies = tempfile.mkdtemp(prefix="bench-where-copies-")
    results = []
    try:
        for arm in ("shardkit cold", "shardkit warm", "pyarrow"):
            if arm == "shardkit warm":  # copies kept, stored result removed: the query runs again
                for f in Path(copies).glob("selection-*"):
                    f.unlink()
            tool = arm.split()[0]
            results.append(_child(tool, local_root if tool == "pyarrow" else url, where, copies))
            results[-1]["arm"] = arm
            print(json.dumps(results[-1]), file=sys.stderr)
        results.append(_child("shardkit", url, where, copies))  # the node's stored result
        results[-1]["arm"] = "shardkit stored"
        print(json.dumps(results[-1]), file=sys.stderr)
    finally:
        shutil.rmtree(copies, ignore_errors=True)
    return results


if __name__ == "__main__":
    main()
