"""GC of the block tier: TTL per traffic class, LRU by capacity watermarks."""
