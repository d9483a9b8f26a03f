"""Per-sequence contexts for the small model: fresh prefill, bounded replay, the decode ring.

``BlockKV`` is what a block-KV cache hit hands back: every layer's compressed entries whose
tokens all lie before the hit length. Bounded replay reuses it verbatim; only SWA keys (and
the compression tail, which is state, not history) are rebuilt.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvstore.errors import InvalidArgument
from kvstore.verify.kvstores import LinearKV, RingKV
from kvstore.verify.model import RING_SLOTS, CompressedKV, LayerContext, V4Model

Entries = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]


@dataclass(frozen=True)
class BlockKV:
    """Cached compressed entries per layer (None for a pure SWA layer), valid up to ``tokens``."""

    tokens: int
    layers: tuple[Entries | None, ...]


def fresh_contexts(model: V4Model, start: int = 0) -> list[LayerContext]:
    """Contexts for a forward from ``start`` with nothing cached (a full prefill when 0)."""
    contexts = []
    for layer in model.layers:
        compressed = CompressedKV(layer, start) if layer.compressor is not None else None
        contexts.append(LayerContext(LinearKV(start, layer.window), compressed))
    return contexts


def block_kv_of(contexts: list[LayerContext], tokens: int) -> BlockKV:
    """What a block-KV cache would hold for the first ``tokens`` positions of a sequence."""
    layers: list[Entries | None] = []
    for context in contexts:
        comp = context.compressed
        layers.append(None if comp is None else comp.entries_before(tokens))
    return BlockKV(tokens, tuple(layers))


def replay_contexts(
    model: V4Model, block_kv: BlockKV, start: int, *, forget_tail: bool = False
) -> list[LayerContext]:
    """Contexts for a bounded replay from ``start``: cached entries, no SWA keys.

    ``forget_tail`` (only for the no-replay baseline, ``start == block_kv.tokens``): pool the
    next compressed entries as if nothing existed before ``start``, since without a replay
    the raw rows of the last few prefix tokens are not known."""
    if not 0 <= start <= block_kv.tokens:
        raise InvalidArgument("start", f"replay start {start} outside [0, {block_kv.tokens}]")
    if len(block_kv.layers) != len(model.layers):
        raise InvalidArgument("block_kv", "layer count does not match the model")
    contexts = []
    for layer, entries in zip(model.layers, block_kv.layers, strict=True):
        compressed = None
        if layer.compressor is not None:
            if entries is None:
                raise InvalidArgument("block_kv", f"no entries for a {layer.kind} layer")
            history_from = start if forget_tail else 0
            compressed = CompressedKV(layer, start, entries, history_from)
        contexts.append(LayerContext(LinearKV(start, layer.window), compressed))
    return contexts


def swa_window(contexts: list[LayerContext], stop: int, length: int) -> list[torch.Tensor]:
    """Per layer, SWA keys and values at ``[stop-length, stop)`` as one ``[length, 2*dh]``."""
    out = []
    for context in contexts:
        store = context.swa
        if not isinstance(store, LinearKV):
            raise InvalidArgument("contexts", "swa_window needs linear key stores")
        keys, values = store.window_rows(stop, length)
        out.append(torch.cat([keys, values], dim=1))
    return out


def ring_contexts(contexts: list[LayerContext], slots: int = RING_SLOTS) -> list[LayerContext]:
    """Move a prefilled sequence into the decode ring (the last ``slots`` positions per layer)."""
    ringed = []
    for context in contexts:
        store = context.swa
        if not isinstance(store, LinearKV):
            raise InvalidArgument("contexts", "ring_contexts needs linear key stores")
        length = min(slots, store.end - store.first_pos)
        keys, values = store.window_rows(store.end, length)
        ring = RingKV.from_window(keys, values, store.end - length, slots, store.window)
        ringed.append(LayerContext(ring, context.compressed))
    return ringed


def greedy_decode(
    model: V4Model,
    contexts: list[LayerContext],
    last_logits: torch.Tensor,
    start: int,
    steps: int,
    lo: int = 0,
) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and the logits of each step, one token at a time from position ``start``.

    ``last_logits`` are the logits of position ``start - 1`` (they pick the first token).
    Returns the ``steps`` chosen tokens and ``[steps, vocab]`` logits of the positions they
    were fed at.
    """
    tokens: list[int] = []
    logits = []
    current = last_logits
    for step in range(steps):
        token = int(torch.argmax(current.float()))
        tokens.append(token)
        hidden = model.forward(torch.tensor([token]), start + step, contexts, lo)
        current = model.logits(hidden)[0]
        logits.append(current)
    return tokens, torch.stack(logits) if logits else torch.empty(0, model.config.vocab)
