"""DeepSpeed engine, training loop, checkpoints and logging."""
