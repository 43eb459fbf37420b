"""Token documents → packed samples → WebDataset shards + manifest. Never imports torch."""
