"""Executable checks on a small V4-style torch model: YoCo mask vs compact, bounded replay.

Modules (each imports torch; this package file does not, so ``import kvstore.cli`` stays light):

- ``model``: the model (SWA 128 in every layer, CSA 4:1 + top-k indexer, HCA 128:1), seeded.
- ``kvstores``: where SWA keys live: linear buffer (off / mask), compact buffer, decode ring.
- ``sequence``: contexts for prefill, bounded replay and the 134-slot decode ring.
- ``yoco``: truncation ``mask`` vs ``compact`` with stated tolerances, broken-compact control.
- ``replay``: bounded replay error (per layer, vs s, logits) and cost vs exact recompute.
- ``ced``: decoder-side replay on an encoder/decoder split.
- ``preemption``: recompute after preemption with truncation off vs on.
- ``measures``: error measures (``Diff``) and timing.
- ``report``: tables.
"""
