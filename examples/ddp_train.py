"""DDP training loop with exact per-rank shares, node cache, and elastic resume.

    torchrun --nproc-per-node 2 examples/ddp_train.py s3://bucket/ds /nvme/shardkit [ckpt.json]

Each rank reads its own exact share of every epoch through the node cache; rank 0 saves the
loader's position every 100 steps, and a restart (with any number of ranks) continues the
epoch from there, each sample once.
"""

import json
import os
import sys

import torch.distributed as dist

from shardkit import StreamingDataLoader, StreamingDataset
from shardkit.batch.collate import unpack

__all__ = ["main"]


def main(url: str, cache: str, ckpt: str | None) -> None:
    """Train two epochs (a stand-in loop that only unpacks the JPEG bytes).

    Args:
        url: the dataset root.
        cache: the node-local cache directory.
        ckpt: a JSON file for the resume state (read at start if it exists), or None.
    """
    dist.init_process_group("gloo")
    ds = StreamingDataset(url, cache_dir=cache, cache_limit="100GB", shuffle=True, seed=0, batch_size=256)
    loader = StreamingDataLoader(ds, num_workers=2, pin_memory=True, persistent_workers=True)
    start = 0
    if ckpt and os.path.exists(ckpt):
        with open(ckpt) as f:
            state = json.load(f)
        loader.load_state_dict(state)  # any world size: the rest of the epoch, each sample once
        start = state["epoch"]
    for epoch in range(start, start + 2):
        ds.set_epoch(epoch)
        for step, batch in enumerate(loader):
            bodies = unpack(batch, "jpg") if "jpg" in batch else []  # raw JPEG bytes per sample
            del bodies  # a real loop decodes and trains here
            if ckpt and step % 100 == 0 and dist.get_rank() == 0:
                with open(ckpt, "w") as f:
                    json.dump(loader.state_dict(), f)
        if dist.get_rank() == 0:
            print(f"epoch {epoch}: {len(loader)} steps/rank; stats {ds.stats()}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else None)
