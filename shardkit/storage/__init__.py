"""Object storage over fsspec and boto3: the :class:`~shardkit.storage.store.Store` (metadata and
small objects), ranged reads into the caller's buffers (:mod:`~shardkit.storage.ranged`), and the
retries, option rules and redaction around them. The one home of boto3 and s3fs code; imports
no other shardkit package but errors, config and util. Nothing is imported here, so importing a
submodule stays cheap.
"""

__all__: list[str] = []
