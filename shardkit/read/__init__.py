"""Reading a committed dataset: manifest access, verification, the partition of samples over ranks
and workers, segments, and the shard source that feeds every reader.
"""
