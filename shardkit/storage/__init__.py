"""Object storage over fsspec: the store, retries and error translation, ranged reads. The one home
of boto3 and s3fs code. Imports no other shardkit package.
"""
