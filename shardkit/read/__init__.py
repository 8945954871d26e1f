"""Reading a committed dataset: its manifest, the samples' bytes checked against it, and who
reads what.

- :mod:`~shardkit.read.dataset`: :class:`Dataset` and :func:`open_dataset` (manifest access,
  sequential reading, verify);
- :mod:`~shardkit.read.manifest`: dataset.json and shards.parquet from storage, and their checks;
- :mod:`~shardkit.read.manifest_copies`: node-local copies of the samples fragments;
- :mod:`~shardkit.read.rows`: one shard's manifest rows as numpy columns;
- :mod:`~shardkit.read.samples`, :mod:`~shardkit.read.decode`: sample dicts sliced out of
  shard bytes, and their fields decoded;
- :mod:`~shardkit.read.verify`, :mod:`~shardkit.read.checked`: bytes checked against the
  manifest, whole or in ranged reads;
- :mod:`~shardkit.read.topology`, :mod:`~shardkit.read.epoch_order`,
  :mod:`~shardkit.read.partition`: where a reader sits, the epoch's sample order, and each
  reader's share of it;
- :mod:`~shardkit.read.segments`, :mod:`~shardkit.read.shard_source`: the shard bytes a
  reader holds, through the node cache or straight from storage.
"""

__all__: list[str] = []  # the modules are imported by name
