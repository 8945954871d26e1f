"""The torch-facing readers: StreamingDataset (streaming, with its resume state, statistics and
source setup), StreamingDataLoader (loader), ShardDataset (random_access, with array_reads and
key_index) and the WebDataset stage (wds). The only package that imports torch (tensors).

``mixed`` is imported here so that ``StreamingDataset([Stream(...), ...])`` finds its reader of
mixtures however the class was imported (it registers itself in ``streaming.READERS``).
"""

from shardkit.datasets import mixed as _mixed  # noqa: F401 - registers the mixture reader

__all__: list[str] = []
