"""Erasure coding 10+2 (ISA-L through pyeclib) with checksummed, versioned shard headers."""
