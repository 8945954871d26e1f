"""DDP training loop with exact per-rank shares, node cache, and elastic resume.

    torchrun --nproc-per-node 2 examples/ddp_train.py s3://bucket/ds /nvme/shardkit [ckpt.json]
"""

import json
import os
import sys

import torch.distributed as dist

from shardkit import StreamingDataLoader, StreamingDataset
from shardkit.batch.collate import unpack

url, cache = sys.argv[1], sys.argv[2]
ckpt = sys.argv[3] if len(sys.argv) > 3 else None
dist.init_process_group("gloo")
ds = StreamingDataset(url, cache_dir=cache, cache_limit="100GB", shuffle=True, seed=0, batch_size=256)
loader = StreamingDataLoader(ds, num_workers=2, pin_memory=True, persistent_workers=True)
start = 0
if ckpt and os.path.exists(ckpt):
    state = json.load(open(ckpt))
    loader.load_state_dict(state)  # any world size: the rest of the epoch, each sample once
    start = state["epoch"]
for epoch in range(start, start + 2):
    ds.set_epoch(epoch)
    for step, batch in enumerate(loader):
        bodies = unpack(batch, "jpg") if "jpg" in batch else []  # raw JPEG bytes per sample
        if ckpt and step % 100 == 0 and dist.get_rank() == 0:
            json.dump(loader.state_dict(), open(ckpt, "w"))
    if dist.get_rank() == 0:
        print(f"epoch {epoch}: {len(loader)} steps/rank; stats {ds.stats()}")
dist.destroy_process_group()
