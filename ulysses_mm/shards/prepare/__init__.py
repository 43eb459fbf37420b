"""``ulysses-mm prepare``: plan the inputs, tokenize them in a pool, pack in input order,
publish shards and the manifest."""
