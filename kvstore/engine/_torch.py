"""The one place kvstore's engine side imports torch, on first use (the ``gpu`` extra).

``import kvstore``, ``import kvstore.cli`` and the fetcher process never import torch: it costs
seconds and hundreds of MB, and most users of the store never touch a device.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

import numpy as np

from kvstore.errors import ConfigError


def torch_module() -> ModuleType:
    """``torch``, imported now; a ``ConfigError`` naming the extra when it is not installed."""
    try:
        import torch
    except ImportError as error:
        raise ConfigError(
            "gpu",
            f"torch is not installed ({error}); install the extra: pip install 'kvstore[gpu]'",
        ) from None
    return torch


def cuda_available() -> bool:
    """True when torch is installed and sees a CUDA device (False without torch)."""
    try:
        return bool(torch_module().cuda.is_available())
    except ConfigError:
        return False


def index_tensor(array: Any, device: Any) -> Any:
    """A small host array (row or slot indices) as a tensor on ``device``.

    On CUDA it goes through pinned memory with ``non_blocking``: a copy from pageable memory may
    make the host wait for the stream, and the streams that use these indices wait on compute.
    """
    torch = torch_module()
    tensor = torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64))
    if getattr(device, "type", str(device)).startswith("cuda"):
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor


def load_row_kernels(rows: Any, stream: Any) -> None:
    """Run the row gather and scatter once on ``stream``, on scratch rows like ``rows``, and
    wait for them (CUDA; at set-up).

    CUDA loads a kernel's module on its first launch, and that load waits for the whole device:
    without this, the first save or load of an engine would stall the step behind the compute
    in flight (seen on an H200: 0.5 s, the length of the kernel then running).
    """
    torch = torch_module()
    with torch.cuda.stream(stream):
        scratch = torch.zeros((2, *rows.shape[1:]), dtype=rows.dtype, device=rows.device)
        ids = torch.zeros(1, dtype=torch.int64, device=rows.device)
        scratch.index_copy_(0, ids, scratch.index_select(0, ids))
    stream.synchronize()


def engine_thread(name: str, serve: Callable[[], None]) -> threading.Thread:
    """Start a daemon thread that runs ``serve`` inside inference mode. Engines run their forward
    in inference mode, so their KV cache (and the host buffers made on their thread) are
    inference tensors, which another thread may write only inside inference mode (it is per
    thread)."""
    torch = torch_module()

    def run() -> None:
        with torch.inference_mode():
            serve()

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread
