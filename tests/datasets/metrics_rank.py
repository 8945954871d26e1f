"""One DDP rank for tests/datasets/test_metrics.py: gloo, StreamingDataLoader with 2 workers,
the stream exported to Prometheus (``metrics_port``).

argv[1] is a JSON config: url, cache_dir, port, ready (a path prefix: ``<ready><rank>`` is
written with the rank's ``stats()`` once its epoch is done), scraped (a path the test writes
once it has scraped; the rank waits for it, at most ``wait`` seconds).
"""

import json
import os
import sys
import time

import torch.distributed as dist

from shardkit import StreamingDataLoader, StreamingDataset


def main() -> None:
    cfg = json.loads(sys.argv[1])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ds = StreamingDataset(cfg["url"], cache_dir=cfg["cache_dir"], cache_limit=cfg["cache_limit"], shuffle=True,
                          seed=3, batch_size=16, metrics_port=cfg["port"])
    loader = StreamingDataLoader(ds, num_workers=2, persistent_workers=True)
    keys = []
    for batch in loader:
        keys += batch["__key__"]
    dist.barrier()  # both ranks' epochs are done: their snapshots are final
    out = {"rank": rank, "keys": keys, "stats": ds.stats(), "served": ds.metrics_port}
    tmp = cfg["ready"] + f"{rank}.tmp"
    with open(tmp, "w") as f:
        json.dump(out, f)
    os.rename(tmp, cfg["ready"] + str(rank))
    deadline = time.monotonic() + cfg.get("wait", 120)
    while not os.path.exists(cfg["scraped"]):  # the test scrapes while every rank is alive
        if time.monotonic() > deadline:
            sys.exit(3)
        time.sleep(0.05)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
