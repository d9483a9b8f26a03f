"""Engine side on the GPU: fetcher process, /dev/shm staging, layer-wise swap-in (torch lazy).

Modules (import them directly; this package imports nothing, and torch is imported only when a
pool, swap-in or saver is built):

- ``kvlayout``  per-layer byte map of block payloads (layer-major) and stored SWA states
- ``staging``   the /dev/shm staging area, per-load regions, per-layer ready words
- ``fetcher``   the fetcher process and its engine-side handle (``Fetcher``, ``StagedFetch``)
- ``pools``     ``DevicePools``: tensors behind the paged block and state slot ledgers
- ``swapin``    ``SwapIn`` copy thread / CUDA side stream, ``LayerLoad.wait(layer)``
- ``save``      ``Saver``: layer-wise gathers, background puts
- ``connector`` ``KVConnector``: a vLLM KV-connector-v1-shaped facade

The tier they read and write is reached through ``kvstore.tier`` (the one seam: the cluster,
files in a directory, or the gRPC client).
"""
