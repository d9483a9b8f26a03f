"""``benchmarks/blockstore.py --zstd``: why blocks are stored uncompressed. zstd's ratio and
speed on bytes shaped like cached KV (bf16 or fp8-e4m3 encodings of normal values)."""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np


def kv_like_bytes(size: int, kind: str, rng: np.random.Generator) -> np.ndarray:
    """Bytes shaped like cached KV: bf16 or fp8-e4m3 encodings of normal values."""
    values = rng.standard_normal(size // 2 if kind == "bf16" else size).astype(np.float32)
    if kind == "bf16":
        return (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)[:size]
    bits = values.view(np.uint32)
    sign = (bits >> 31).astype(np.uint8) << 7
    exponent = np.clip(((bits >> 23) & 0xFF).astype(np.int32) - 127 + 7, 0, 15).astype(np.uint8)
    mantissa = ((bits >> 20) & 0x7).astype(np.uint8)
    return (sign | (exponent << 3) | mantissa).astype(np.uint8)


def measure_zstd(rng: np.random.Generator, size: int) -> list[dict[str, Any]]:
    """zstd levels 1 and 3 on ``size`` bytes of each kind: ratio and MB/s (median of 5)."""
    import zstandard

    rows = []
    for kind in ("bf16", "fp8-e4m3"):
        data = kv_like_bytes(size, kind, rng).tobytes()
        for level in (1, 3):
            compressor = zstandard.ZstdCompressor(level=level)
            seconds = []
            compressed = b""
            for _ in range(5):
                start = time.perf_counter()
                compressed = compressor.compress(data)
                seconds.append(time.perf_counter() - start)
            rows.append(
                {
                    "values": kind,
                    "level": level,
                    "ratio": len(data) / len(compressed),
                    "compress_mbps": len(data) / statistics.median(seconds) / 1e6,
                }
            )
    return rows
