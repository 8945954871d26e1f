"""A WebDataset pipeline fed by shardkit's node cache and epoch order.

    python examples/wds_pipeline.py s3://bucket/ds /nvme/shardkit

``shardkit.wds_shards`` is the pipeline's first stage: it yields the local paths of this
reader's cached, verified shards in the epoch's order; WebDataset does the rest.
"""

import sys

import webdataset as wds
from torch.utils.data import DataLoader

import shardkit

__all__ = ["main"]


def main(url: str, cache: str) -> None:
    """Read two epochs through the pipeline and print how many samples each had.

    Args:
        url: the dataset root.
        cache: the node-local cache directory.
    """
    stage = shardkit.wds_shards(url, cache_dir=cache, cache_limit="50GB", shuffle=True, seed=0)
    pipeline = wds.DataPipeline(stage, wds.tarfile_to_samples(), wds.shuffle(100), wds.decode("pil"), wds.batched(16))
    for epoch in range(2):
        stage.set_epoch(epoch)
        n = sum(len(b["__key__"]) for b in DataLoader(pipeline, batch_size=None, num_workers=2))
        print(f"epoch {epoch}: {n} samples")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
