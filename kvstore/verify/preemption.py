"""Preemption under YoCo truncation: recompute may change results when truncation is on.

A sequence is prefilled, decodes greedily on the 134-slot ring, and is preempted after some
steps: its state is dropped and must be recomputed before decoding resumes.

- truncation ``off``: the engine kept the whole prefill buffer's worth of history, so the
  recompute is a full prefill of prompt + generated tokens: the same function of the same
  tokens, equal up to floating-point reduction order.
- truncation on (``mask``/``compact``): only a bounded suffix was kept, so the recompute resumes
  from the kept anchor. It is a prefix hit on block KV at ``L1`` (docs/rules.md §5: at most
  ``n - 134``, a multiple of 128) plus a bounded replay from ``L1 - 128`` whose windows are
  truncated there. The rebuilt SWA state is approximate past layer 0, so the logits after the
  resume differ from an uninterrupted run, and greedy tokens may differ.

This is documented behaviour (the article: "开启 yoco 截断时,允许抢占导致的结果变化"), not
a bug; a determinism-sensitive user must either turn truncation off or avoid preemption.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvstore.errors import ConfigError
from kvstore.verify.measures import Diff, diff
from kvstore.verify.model import RING_SLOTS, WINDOW, V4Model
from kvstore.verify.sequence import (
    block_kv_of,
    fresh_contexts,
    greedy_decode,
    replay_contexts,
    ring_contexts,
)


@dataclass(frozen=True)
class PreemptionOutcome:
    truncation: str  # "off" or "on"
    resumed_from: int  # first position recomputed after the preemption
    logits: Diff  # resumed vs uninterrupted, over the steps after the preemption
    same_tokens: bool
    tokens_uninterrupted: tuple[int, ...]
    tokens_resumed: tuple[int, ...]

    def as_dict(self) -> dict[str, object]:
        return {
            "truncation": self.truncation,
            "resumed_from": self.resumed_from,
            **self.logits.as_dict(),
            "same_tokens": self.same_tokens,
        }


def preempt_and_resume(
    model: V4Model, prompt: torch.Tensor, steps: int, preempt_after: int, truncation: bool
) -> PreemptionOutcome:
    """Decode ``steps`` greedy tokens uninterrupted, and again with a preemption after
    ``preempt_after`` steps; compare what comes after the preemption."""
    if not 0 < preempt_after < steps:
        raise ConfigError("preempt_after", f"must lie in (0, {steps}), got {preempt_after}")
    if prompt.shape[0] < 2 * WINDOW + RING_SLOTS:
        raise ConfigError("prompt", f"needs >= {2 * WINDOW + RING_SLOTS} tokens for a block hit")
    n_prompt = prompt.shape[0]
    with torch.inference_mode():
        contexts = fresh_contexts(model)
        last = model.logits(model.forward(prompt, 0, contexts)[-1:])[0]
        tokens_a, logits_a = greedy_decode(model, ring_contexts(contexts), last, n_prompt, steps)
        # Preempted after `preempt_after` steps: those tokens were emitted, the state is gone.
        done = torch.cat([prompt, torch.tensor(tokens_a[:preempt_after])])
        n = done.shape[0]
        if truncation:
            hit = (n - RING_SLOTS) // WINDOW * WINDOW  # docs/rules.md §5 cap, whole blocks
            start = hit - WINDOW
            # Block KV was cached by the original prefill (whole blocks before `hit`).
            block_kv = block_kv_of(contexts, hit)
            resumed = replay_contexts(model, block_kv, start)
            hidden = model.forward(done[start:], start, resumed, lo=start)
        else:
            start = 0
            resumed = fresh_contexts(model)
            hidden = model.forward(done, 0, resumed)
        last_b = model.logits(hidden[-1:])[0]
        rest = steps - preempt_after
        tokens_b, logits_b = greedy_decode(model, ring_contexts(resumed), last_b, n, rest, lo=start)
    # Compare the logits that chose the tokens after the preemption: step preempt_after's
    # choice comes from the logits of position n-1.
    after_a = logits_a[preempt_after - 1 : -1]
    after_b = torch.cat([last_b[None], logits_b[:-1]])
    tokens_after = tuple(tokens_a[preempt_after:])
    return PreemptionOutcome(
        truncation="on" if truncation else "off",
        resumed_from=start,
        logits=diff(after_b, after_a),
        same_tokens=tuple(tokens_b) == tokens_after,
        tokens_uninterrupted=tokens_after,
        tokens_resumed=tuple(tokens_b),
    )
