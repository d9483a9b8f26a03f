"""A CPU engine's KV cache in shared memory, so the fetcher lands loads in the rows themselves.

On a CPU engine the KV cache is the engine process's own memory, so a load was copied once more
after the socket: into the /dev/shm staging region by the fetcher, then by swap-in into the rows
(87 MB a warm request of ``vllm_ttft.py``: 10-19 ms of ~190 ms, benchmarks/README.md). Once,
when the engine registers its cache, ``SharedKV.move`` puts the cache's memory into an anonymous
shared file (``memfd_create``: no name anywhere, so nobody can open, plant or swap it) and points
every tensor handed to the connector at the same bytes there (``Tensor.set_``; tensors that share
a storage keep sharing it). The engine computes on the file's pages from then on; the fetcher
process inherits the descriptor and maps it, and a direct read receives each shard straight into
the request's rows (``kvstore.engine.fetcher``).

Who writes where, and when: the fetcher writes only the rows its job names (the blocks vLLM
gave the request), and only before it answers the job. A step never ends while such a job is
unanswered (``PagedWorker.finish_step``): after the step vLLM may recompute those rows or hand
them to another request. A fetcher that does not answer in time is killed, so it can write
nothing later.

Memory: the file's pages are reserved when it is made (``posix_fallocate``), so a machine short
of shared memory refuses here (the engine then loads through staging as before) instead of
killing the engine with SIGBUS at the first touch. While the bytes move, the cache exists
twice.
"""

from __future__ import annotations

import logging
import mmap
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from kvstore.engine.staging import round_up
from kvstore.errors import InvalidArgument

if TYPE_CHECKING:
    import torch

    from kvstore.engine.kvlayout import KVLayout

log = logging.getLogger(__name__)

_PAGE = mmap.PAGESIZE


class SharedKV:
    """The moved cache: its file (``fd``, ``nbytes``), per layer where the layer's row 0 lies
    in the file (``places``), and each layer's rows (``num_rows``: the engine's blocks). Made
    by ``move``; ``close`` closes the descriptor (the engine's tensors keep the mapping)."""

    def __init__(
        self,
        fd: int,
        nbytes: int,
        places: tuple[int, ...],
        num_rows: int,
        mapping: mmap.mmap,
        base: int,
    ) -> None:
        self.fd = fd
        self.nbytes = nbytes
        self.places = places
        self.num_rows = num_rows
        self._mapping = mapping  # the tensors' memory: kept for as long as this object lives
        self._base = base

    @classmethod
    def move(cls, layers: Sequence[torch.Tensor], views: Sequence[torch.Tensor] = ()) -> SharedKV:
        """Move the memory behind ``layers`` (CPU tensors) into a new shared file; ``places``
        in their order. ``views``: other tensors over that memory that the engine computes on
        (vLLM's attention layers may hold views of their own, e.g. in kernel blocks), pointed
        at the file too. Raises ``OSError`` when the file cannot be made or reserved,
        ``ValueError`` for a tensor not on the CPU or a view of other memory (the engine would
        compute on bytes the loads never reach); nothing has moved then."""
        import torch

        storages: dict[int, tuple[torch.UntypedStorage, int]] = {}
        size = 0
        for index, tensor in enumerate(layers):
            if tensor.device.type != "cpu":
                raise ValueError(f"layers[{index}]: on {tensor.device}, not the CPU")
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in storages:
                storages[storage.data_ptr()] = (storage, size)
                size = round_up(size + storage.nbytes(), _PAGE)
        for index, view in enumerate(views):
            if view.device.type != "cpu" or view.untyped_storage().data_ptr() not in storages:
                raise ValueError(f"views[{index}]: not a view of the layers' memory")
        size = max(size, _PAGE)
        fd = os.memfd_create("kvstore-kv-cache", os.MFD_CLOEXEC)
        try:
            os.posix_fallocate(fd, 0, size)
            mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        whole = torch.frombuffer(mapping, dtype=torch.uint8)
        target = whole.untyped_storage()
        for storage, at in storages.values():
            old = torch.empty(0, dtype=torch.uint8).set_(storage)
            whole[at : at + storage.nbytes()].copy_(old)
        # Every place first: one tensor may be handed over twice (layers sharing their KV), or
        # be one of the views too.
        pointed = [*layers, *views]
        offsets = [
            storages[t.untyped_storage().data_ptr()][1] // t.element_size()
            + int(t.storage_offset())
            for t in pointed
        ]
        for tensor, offset in zip(pointed, offsets, strict=True):
            tensor.set_(target, offset, tensor.size(), tensor.stride())
        places = [offset * t.element_size() for t, offset in zip(layers, offsets, strict=False)]
        num_rows = int(layers[0].shape[0]) if layers else 0
        return cls(fd, size, tuple(places), num_rows, mapping, whole.data_ptr())

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor``'s bytes lie in this file (each moved tensor's do)."""
        start = tensor.data_ptr()
        end = start + tensor.numel() * tensor.element_size()
        return self._base <= start and end <= self._base + self.nbytes

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class KVFile:
    """The fetcher's side of a ``SharedKV``: the file's bytes, per layer where its row 0 lies
    (``SharedKV.places``), and how many rows each layer has."""

    def __init__(self, buffer: np.ndarray, places: Sequence[int], num_rows: int) -> None:
        self.buffer = buffer
        self.places = tuple(int(place) for place in places)
        self.num_rows = int(num_rows)
        if any(not 0 <= place < len(buffer) for place in self.places) or self.num_rows < 0:
            raise ValueError(f"places: outside the {len(buffer)} B file")

    @classmethod
    def map(cls, fd: int, places: Sequence[int], num_rows: int) -> KVFile:
        """Map an inherited ``SharedKV`` descriptor."""
        size = os.fstat(fd).st_size
        mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        return cls(np.frombuffer(mapping, dtype=np.uint8), places, num_rows)

    def segments(self, kv: KVLayout) -> tuple[tuple[int, int, int], ...]:
        """Where a block's bytes go (``kvstore.blockstore.readblocks.Spread``): each layer's slice
        to that layer's rows, block b's in row b."""
        if len(self.places) != kv.num_layers:
            raise ValueError(f"places: {len(self.places)} for {kv.num_layers} layers")
        return tuple(
            (item.block_offset, item.block_nbytes, self.places[item.layer])
            for item in kv.layers
            if item.block_nbytes
        )

    def rows(self, layer: int, row_bytes: int) -> np.ndarray:
        """Layer ``layer``'s rows as ``[num_rows, row_bytes]``."""
        start = self.places[layer]
        return self.buffer[start : start + self.num_rows * row_bytes].reshape(-1, row_bytes)


def check_rows(rows: Sequence[int] | np.ndarray, num_rows: int, count: int) -> np.ndarray:
    """``rows`` as an array: one per block of a load (``count``), each a row of the engine's
    cache (``num_rows``); InvalidArgument otherwise (a write must never leave its rows)."""
    array = np.asarray(rows, dtype=np.int64).reshape(-1)
    if array.size != count:
        raise InvalidArgument("rows", f"{array.size} rows for {count} blocks")
    if array.size and (array.min() < 0 or array.max() >= num_rows):
        raise InvalidArgument("rows", f"must lie in [0, {num_rows})")
    return array


def move_or_none(
    layers: Sequence[torch.Tensor], views: Sequence[torch.Tensor] = ()
) -> SharedKV | None:
    """``SharedKV.move``, or None (said in the log) where it cannot be: loads then land in
    staging and swap-in copies them, as on an engine whose cache is on a GPU."""
    try:
        return SharedKV.move(layers, views)
    except (OSError, ValueError) as error:
        log.warning("kvstore: the KV cache stays private, loads go through staging: %s", error)
        return None
