"""SWA KVCache tier: per-machine state stores, entrypoint directory, fetch-or-replay advice."""
