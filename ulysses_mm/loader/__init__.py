"""Shards → batches for training: order, mixing, state, fetch ahead, node cache, stream,
batch."""
