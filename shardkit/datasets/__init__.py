"""The torch-facing readers: StreamingDataset (streaming, with its resume state, statistics and
source setup), StreamingDataLoader (loader), ShardDataset (random_access, with array_reads and
key_index) and the WebDataset stage (wds). The only package that imports torch (tensors).
"""

__all__: list[str] = []
