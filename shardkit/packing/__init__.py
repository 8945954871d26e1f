"""Packing a source into a dataset: sources, the plan, the shard writer, destination safety and
claims, the local and Ray engines, and the index of existing tars.
"""
