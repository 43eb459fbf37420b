"""Data, in two houses that share one torch-free description of the shard format (format.py).

Offline, never importing torch: prepare (inputs, workers, assemble, output), packing,
shards, manifest, inspect. Online, for training: stream (shards by URL) and batch (model
inputs, torch).
"""
