"""Block KVCache tier: storage nodes, meta shards, placement, client, repair."""
