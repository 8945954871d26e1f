"""One reader of tests/soak/test_soak.py: rank ``rank`` of 2 (explicit, no process group), a
StreamingDataLoader with 2 persistent workers, many epochs through a tiny shared node cache.

argv[1] is a JSON config: url, cache_dir, cache_limit, rank, epochs, out (JSON lines, one per
epoch: the keys read, an xxh3-64 of each sample's bytes, and this process's and its workers' RSS, threads, fds and children).
"""

import gc
import json
import os
import sys

import xxhash

from shardkit import StreamingDataLoader, StreamingDataset, unpack


def _status(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return -1


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            fields = stat[stat.rfind(")") + 2:].split()
            if int(fields[1]) == pid and fields[0] not in ("Z", "X"):
                out.append(int(entry))
    return sorted(out)


def _deleted_mapped(pids: list[int], cache_dir: str) -> int:
    """Bytes of files under the cache that are unlinked but still mapped by ``pids``."""
    seen: dict[str, int] = {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    if cache_dir in line and line.rstrip().endswith("(deleted)"):
                        lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                        inode = line.split()[4]
                        seen[inode] = max(seen.get(inode, 0), hi - lo)
        except OSError:
            continue
    return sum(seen.values())


def main() -> None:
    cfg = json.loads(sys.argv[1])
    me = os.getpid()
    ds = StreamingDataset(cfg["url"], cache_dir=cfg["cache_dir"], cache_limit=cfg["cache_limit"], shuffle=True,
                          seed=5, batch_size=8, shuffle_block=2, rank=cfg["rank"], world_size=2)
    loader = StreamingDataLoader(ds, num_workers=2, persistent_workers=True)
    with open(cfg["out"], "w") as out:
        for epoch in range(cfg["epochs"]):
            ds.set_epoch(epoch)
            keys, digests = [], []
            for batch in loader:
                keys.extend(batch["__key__"])
                digests.extend(xxhash.xxh3_64_hexdigest(b) for b in unpack(batch, "bin"))
            gc.collect()
            kids = _children(me)
            out.write(json.dumps({
                "epoch": epoch, "keys": keys, "digests": digests, "rss_kb": _status(me, "VmRSS"),
                "worker_rss_kb": [_status(p, "VmRSS") for p in kids], "threads": len(os.listdir("/proc/self/task")),
                "fds": len(os.listdir("/proc/self/fd")), "children": kids,
                "deleted_mapped": _deleted_mapped([me, *kids], cfg["cache_dir"]),
            }) + "\n")
            out.flush()
        out.write(json.dumps({"stats": ds.stats()}) + "\n")
    del loader, ds
    gc.collect()


if __name__ == "__main__":
    main()
