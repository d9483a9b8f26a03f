"""The tier seam: one way to ask how much of a prompt is cached, read and write blocks and states.

- ``records``   what crosses the seam: ``HitAnswer``, ``BlockRead``, ``StateRead``,
                ``PutAnswer``, ``Stats``
- ``protocols`` what callers need: ``HitSource``, ``TierReader``, ``TierWriter`` and ``Tier``
                (all three plus figures: what the gateway serves)
- ``hit``       the two-tier hit composition (docs/rules.md §5) every implementation uses
- ``coalesce``  concurrent callers of one operation share a batched call
- ``leases``    the bounded, expiring table of leases handed out by id
- ``cluster``   ``ClusterTier``: the deployed cluster (no Ray here: transports are injected)
- ``files``     ``DirectoryTier``: checksummed files in one directory (one machine, tests)

The gRPC client (``kvstore.api.client.KVStoreClient``) is the third implementation; the
servicer, the engine connector, the demo engines and the chaos load are its callers.
"""
