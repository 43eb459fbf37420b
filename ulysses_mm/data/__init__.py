"""Packing, shards, streaming and model inputs."""
