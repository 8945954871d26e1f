"""The torch-facing readers: StreamingDataset, StreamingDataLoader, ShardDataset and the
WebDataset stage. The only package that imports torch.
"""
