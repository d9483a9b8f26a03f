"""Failure injection for kvstore: scenarios over a deployed tier on a local multi-node cluster.

- ``tier``: ``ChaosTier`` — the block tier (13+ storage nodes, one per machine), the SWA tier and
  the repair loop deployed on a ``LocalCluster``, plus a ledger of every committed block.
- ``ledger``: what was committed and what its bytes must hash to (a read is OK, a miss or wrong).
- ``load``: bounded background read/write load with per-read verification.
- ``grpc_load``: M concurrent gRPC clients against a gateway, with latency percentiles.
- ``faults``: kill, crash, restart, corrupt, slow down.
- ``catalog`` / ``scenarios``: the ten scenarios, one plain function each, returning a row.
- ``table``: the result row and its table / JSON rendering.

``kvstore chaos`` runs them from the command line; ``tests/chaos`` runs them under pytest.
"""
