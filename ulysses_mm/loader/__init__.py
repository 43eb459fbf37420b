"""Shards → batches for training: order, mixing, fetch ahead, node cache, stream, batch."""
