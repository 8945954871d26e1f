"""Tools for trying shardkit out: a throwaway SeaweedFS server, the demo and sample data.
"""
