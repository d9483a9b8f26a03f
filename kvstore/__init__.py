"""kvstore: a distributed KV-cache storage tier for DeepSeek-V4-class inference fleets."""

__version__ = "0.1.0"
