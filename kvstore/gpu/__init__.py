"""Engine side on the GPU: fetcher process, /dev/shm staging, layer-wise swap-in (torch lazy)."""
