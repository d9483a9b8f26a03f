"""Engine side on the GPU: fetcher process, /dev/shm staging, layer-wise swap-in (torch lazy).

Modules (import them directly; this package imports nothing, and torch is imported only when a
pool, swap-in or saver is built):

- ``kvlayout``  per-layer byte map of block payloads (layer-major) and stored SWA states
- ``staging``   the /dev/shm staging area, per-load regions, per-layer ready words
- ``fetcher``   the fetcher process and its engine-side handle (``Fetcher``, ``StagedFetch``)
- ``pools``     ``DevicePools``: tensors behind the paged block and state slot ledgers
- ``swapin``    ``SwapIn`` copy thread / CUDA side stream, ``LayerLoad.wait(layer)``
- ``save``      ``Saver``: layer-wise gathers, background puts

The engine's connector is ``kvstore.integrations`` (``paged``: the engine-neutral core, which
uses the fetcher and staging; ``vllm``: vLLM's KV connector over it). ``pools``, ``swapin`` and
``save`` are the V4 engine side (SWA state slots, decode snapshots) for an engine that keeps
kvstore's own pools.

The tier they read and write is reached through ``kvstore.tier`` (the one seam: the cluster,
files in a directory, or the gRPC client).
"""
