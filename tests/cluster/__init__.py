"""Packing on a real multi-node Ray cluster started on this machine (see raycluster.py)."""
