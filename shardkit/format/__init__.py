"""The on-storage format, shared by the pack and read sides: tar members, tar scanning, checksums,
manifest schemas, rows and fragments. Imports no other shardkit package.
"""
