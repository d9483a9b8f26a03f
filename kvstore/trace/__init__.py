"""Request traces (Mooncake's JSONL format) replayed through the tier and the fleet model."""
