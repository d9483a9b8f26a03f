"""A small DeepSeek-V4-style model in torch, built only to make the article's claims executable.

Every layer has a 128-token sliding window (SWA) over its own keys. CSA layers add a 4:1
compressed branch whose windows overlap (8 tokens pooled per entry, stride 4) and a top-k
indexer that picks which entries a query sees; HCA layers add a dense 128:1 compressed branch.
One softmax (with a per-head sink) runs over the SWA keys and the compressed entries together.
The math is real attention; the sizes are tiny so it runs on two CPU cores. Weights come from a
seeded ``torch.Generator`` in fp32 and are cast for other dtypes, so an fp32 and a bf16 model
share their weights exactly.

The model never owns sequence state: every forward call receives one ``LayerContext`` per layer
(an SWA key store from ``kvstore.verify.kvstores`` and a ``CompressedKV``), so prefill, chunked
prefill, the decode ring, mask/compact truncation and bounded replay all run the same layer math
and differ only in where their keys come from.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

import torch

from kvstore.errors import ConfigError, InvalidArgument

#: SWA window (docs/rules.md §3 n_win) and maximum speculative-decoding backtracking.
WINDOW = 128
BACKTRACK = 6
#: The decode (CE) ring: window + backtracking slots per SWA layer.
RING_SLOTS = WINDOW + BACKTRACK

#: Layer kinds. "xdec" is a CED decoder layer whose compressed (global) KV is projected from an
#: external hidden state (the encoder's last layer) instead of the layer's own input.
LAYER_KINDS = ("swa", "csa", "hca", "xdec")


@dataclass(frozen=True)
class Compressor:
    """How a compressed branch pools tokens into entries.

    Entry ``j`` pools positions ``[ratio*(j+1) - window, ratio*(j+1))`` (positions below 0 are
    left out) and becomes visible to query ``i`` once ``ratio*(j+1) - 1 <= i``.
    """

    ratio: int
    window: int
    top_k: int  # 0: attend to every visible entry; > 0: the indexer picks this many


def compressor_for(kind: str, csa_top_k: int) -> Compressor | None:
    if kind == "csa":
        return Compressor(ratio=4, window=8, top_k=csa_top_k)
    if kind == "hca":
        return Compressor(ratio=128, window=128, top_k=0)
    if kind == "xdec":
        return Compressor(ratio=4, window=4, top_k=0)
    return None


def v4_layer_kinds(n_layers: int) -> tuple[str, ...]:
    """V4-Flash's pattern at any depth: pure SWA first (2 layers from depth 4 on), then CSA and
    HCA alternate."""
    if n_layers < 1:
        raise ConfigError("layers", f"must be >= 1, got {n_layers}")
    pure = 2 if n_layers >= 4 else 1
    return ("swa",) * pure + tuple("csa" if i % 2 == 0 else "hca" for i in range(n_layers - pure))


@contextmanager
def torch_settings(threads: int = 2) -> Iterator[None]:
    """At most ``threads`` intra-op threads and deterministic algorithms, restored on exit (the
    checks share a small machine and their results must not depend on scheduling)."""
    previous_threads = torch.get_num_threads()
    previous_det = torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(max(1, min(threads, previous_threads)))
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous_det)
        torch.set_num_threads(previous_threads)


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the small model. Defaults follow the V4-Flash pattern: pure SWA first, then
    CSA and HCA alternate."""

    layer_kinds: tuple[str, ...] = ("swa", "swa", "csa", "hca", "csa", "hca")
    d_model: int = 64
    n_heads: int = 2
    head_dim: int = 32
    index_dim: int = 16
    d_ff: int = 128
    vocab: int = 256
    csa_top_k: int = 16
    window: int = WINDOW
    seed: int = 0
    #: Scales the query weights: random weights give near-uniform attention; trained models
    #: attend sharply, so a wrong or missing key must matter as much here as it would there.
    score_gain: float = 4.0
    #: Queries processed per attention block in a long forward (bounds memory, not results).
    query_block: int = 128

    def __post_init__(self) -> None:
        if not isinstance(self.score_gain, int | float) or not self.score_gain > 0:
            raise ConfigError("score_gain", f"must be > 0, got {self.score_gain!r}")
        if not self.layer_kinds:
            raise ConfigError("layer_kinds", "needs at least one layer")
        for kind in self.layer_kinds:
            if kind not in LAYER_KINDS:
                raise ConfigError("layer_kinds", f"unknown kind {kind!r}; one of {LAYER_KINDS}")
        for name in ("d_model", "n_heads", "head_dim", "index_dim", "d_ff", "vocab"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(name, f"must be a positive integer, got {value!r}")
        if self.head_dim % 2:
            raise ConfigError("head_dim", f"must be even (rotary halves), got {self.head_dim}")
        if self.csa_top_k < 1:
            raise ConfigError("csa_top_k", f"must be >= 1, got {self.csa_top_k}")
        if self.window < 1:
            raise ConfigError("window", f"must be >= 1, got {self.window}")
        if self.query_block < 1:
            raise ConfigError("query_block", f"must be >= 1, got {self.query_block}")

    @property
    def n_layers(self) -> int:
        return len(self.layer_kinds)


def _normal(gen: torch.Generator, shape: tuple[int, ...], std: float) -> torch.Tensor:
    return torch.randn(shape, generator=gen, dtype=torch.float32) * std


class Layer:
    """Weights of one layer plus its math. Raw compression rows pack, per token:
    ``[key | value | gate | index key | index gate]`` (index parts only with a top-k indexer)."""

    def __init__(self, kind: str, config: ModelConfig, gen: torch.Generator) -> None:
        d, h, dh, di = config.d_model, config.n_heads, config.head_dim, config.index_dim
        self.kind = kind
        self.n_heads, self.head_dim, self.index_dim = h, dh, di
        self.window = config.window
        self.compressor = compressor_for(kind, config.csa_top_k)
        # Residual branches are scaled down so 6+ random layers stay well-conditioned.
        branch = 1.0 / math.sqrt(2.0 * config.n_layers)
        self.norm1 = torch.ones(d)
        self.norm2 = torch.ones(d)
        self.wq = _normal(gen, (d, h * dh), config.score_gain / math.sqrt(d))
        self.wk = _normal(gen, (d, dh), 1.0 / math.sqrt(d))
        self.wv = _normal(gen, (d, dh), 1.0 / math.sqrt(d))
        self.wo = _normal(gen, (h * dh, d), branch / math.sqrt(h * dh))
        self.sink = _normal(gen, (h,), 1.0)
        self.w1 = _normal(gen, (d, config.d_ff), 1.0 / math.sqrt(d))
        self.w2 = _normal(gen, (config.d_ff, d), branch / math.sqrt(config.d_ff))
        self.w_raw: torch.Tensor | None = None
        self.gate_bias: torch.Tensor | None = None
        self.index_gate_bias: torch.Tensor | None = None
        self.wiq: torch.Tensor | None = None
        comp = self.compressor
        if comp is not None:
            width = 3 * dh + (2 * di if comp.top_k else 0)
            self.w_raw = _normal(gen, (d, width), 1.0 / math.sqrt(d))
            self.gate_bias = _normal(gen, (comp.window, dh), 0.5)
            if comp.top_k:
                self.index_gate_bias = _normal(gen, (comp.window, di), 0.5)
                self.wiq = _normal(gen, (d, di), 1.0 / math.sqrt(d))

    def cast(self, dtype: torch.dtype) -> Layer:
        clone = object.__new__(Layer)
        for name, value in vars(self).items():
            setattr(clone, name, value.to(dtype) if isinstance(value, torch.Tensor) else value)
        return clone

    # --- pieces ----------------------------------------------------------------------------

    def raw_rows(self, normed: torch.Tensor) -> torch.Tensor:
        """Per-token rows the compressor pools (computed from the compression source)."""
        assert self.w_raw is not None
        return normed @ self.w_raw

    def compress(
        self, raw: torch.Tensor, raw_start: int, first: int, stop: int, history_from: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Entries ``[first, stop)`` pooled from ``raw`` (rows for positions from raw_start).

        Positions before ``history_from`` do not exist and are left out of the pooling (0 for
        a real sequence; only the no-replay baseline pretends history starts later)."""
        comp = self.compressor
        assert comp is not None and self.gate_bias is not None
        dh, di = self.head_dim, self.index_dim
        ends = (torch.arange(first, stop) + 1) * comp.ratio
        positions = ends[:, None] - comp.window + torch.arange(comp.window)[None, :]
        present = positions >= history_from
        if bool((positions[present] < raw_start).any()):
            raise InvalidArgument(
                "raw_start",
                f"entries {first}..{stop} need positions before {raw_start} that are not held",
            )
        rows = raw[(positions - raw_start).clamp(min=0)]  # [entries, window, width]
        absent = ~present[..., None]
        gate = (rows[..., 2 * dh : 3 * dh] + self.gate_bias).masked_fill(absent, -math.inf)
        weights = torch.softmax(gate.float(), dim=1).to(raw.dtype)
        keys = (weights * rows[..., :dh]).sum(dim=1)
        values = (weights * rows[..., dh : 2 * dh]).sum(dim=1)
        index_keys = None
        if comp.top_k:
            assert self.index_gate_bias is not None
            igate = rows[..., 3 * dh + di :] + self.index_gate_bias
            iweights = torch.softmax(igate.masked_fill(absent, -math.inf).float(), dim=1)
            index_keys = (iweights.to(raw.dtype) * rows[..., 3 * dh : 3 * dh + di]).sum(dim=1)
        return keys, values, index_keys

    def forward(
        self,
        x: torch.Tensor,
        start: int,
        context: LayerContext,
        lo: int,
        query_block: int,
    ) -> torch.Tensor:
        """Run this layer on rows ``x`` for positions ``[start, start+n)``.

        Query ``i`` sees SWA keys at positions ``[max(lo, i-window+1), i]`` that its key store
        still holds, and the compressed entries visible to it. ``lo`` is the bounded-replay
        start (0 for a normal forward).
        """
        n = x.shape[0]
        h, dh = self.n_heads, self.head_dim
        normed = rmsnorm(x, self.norm1)
        positions = torch.arange(start, start + n)
        q = (normed @ self.wq).view(n, h, dh)
        q_rot = _rope(q, positions)
        k_rot = _rope((normed @ self.wk)[:, None, :], positions)[:, 0, :]
        v = normed @ self.wv
        context.swa.append(k_rot, v, start)
        comp = context.compressed
        index_q = None
        if comp is not None:
            if self.kind != "xdec":  # xdec entries are projected ahead of time from the encoder
                comp.extend(self.raw_rows(normed), start)
            if self.wiq is not None:
                index_q = normed @ self.wiq
        q_heads = q_rot.transpose(0, 1)  # [h, n, dh]: one matmul per block for all heads
        q_plain = q.transpose(0, 1)  # compressed entries carry no rotary phase
        sink = self.sink.view(h, 1, 1)
        scale = 1.0 / math.sqrt(dh)
        out = torch.empty(h, n, dh, dtype=x.dtype)
        for b0 in range(0, n, query_block):
            b1 = min(n, b0 + query_block)
            qpos = positions[b0:b1]
            keys, values, key_pos = context.swa.view(start + b0, start + b1)
            unseen = (
                (key_pos[None, :] < max(lo, 0))
                | (key_pos[None, :] > qpos[:, None])
                | (key_pos[None, :] <= qpos[:, None] - self.window)
            )
            swa = (q_heads[:, b0:b1] @ keys.T) * scale
            scores = [sink.expand(h, b1 - b0, 1), swa.masked_fill(unseen[None], -math.inf)]
            picked = None
            if comp is not None:
                picked = comp.select(None if index_q is None else index_q[b0:b1], qpos)
                if picked is not None:
                    cscores = picked.scores(q_plain[:, b0:b1]) * scale
                    scores.append(cscores.masked_fill(~picked.allowed[None], -math.inf))
            probs = torch.softmax(torch.cat(scores, dim=-1).float(), dim=-1).to(x.dtype)
            m = keys.shape[0]
            block = probs[..., 1 : 1 + m] @ values
            if picked is not None:
                block = block + picked.mix(probs[..., 1 + m :])
            out[:, b0:b1] = block
        out = out.transpose(0, 1).reshape(n, h * dh)
        x = x + out @ self.wo
        mlp = torch.nn.functional.gelu(rmsnorm(x, self.norm2) @ self.w1)
        return x + mlp @ self.w2


@dataclass
class PickedEntries:
    """Compressed entries one block of queries attends to."""

    keys: torch.Tensor  # [c, dh] shared, or [n, k, dh] per query (top-k)
    values: torch.Tensor
    allowed: torch.Tensor  # [n, c] or [n, k]

    def scores(self, q_heads: torch.Tensor) -> torch.Tensor:
        """``q_heads [h, n, dh]`` -> scores ``[h, n, c or k]``."""
        if self.keys.dim() == 2:
            return q_heads @ self.keys.T
        return torch.bmm(q_heads.transpose(0, 1), self.keys.transpose(1, 2)).transpose(0, 1)

    def mix(self, probs: torch.Tensor) -> torch.Tensor:
        """``probs [h, n, c or k]`` -> ``[h, n, dh]``."""
        if self.values.dim() == 2:
            return probs @ self.values
        return torch.bmm(probs.transpose(0, 1), self.values).transpose(0, 1)


class SwaKeyStore(Protocol):
    """Where one layer's SWA keys live (see ``kvstore.verify.kvstores``)."""

    def append(self, keys: torch.Tensor, values: torch.Tensor, start: int) -> None: ...

    def view(self, q_lo: int, q_hi: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Keys, values and their positions (-1: hidden) for queries ``[q_lo, q_hi)``."""
        ...

    def truncate(self, keep: int) -> None:
        """YoCo truncation: keep only the last ``keep`` positions (how depends on the store)."""
        ...

    @property
    def rows(self) -> int:
        """Rows of key memory held."""
        ...


class CompressedKV:
    """One layer's compressed entries (block KV) plus the raw tail still being pooled.

    ``entries`` are history: they can come from a cache (bounded replay reuses them and never
    recomputes or overwrites them). The tail is state: rows for the newest positions, kept so
    the next entries can be pooled.
    """

    def __init__(
        self,
        layer: Layer,
        tail_start: int,
        entries: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None,
        history_from: int = 0,
    ) -> None:
        comp = layer.compressor
        assert comp is not None
        self.layer = layer
        self.comp = comp
        dtype = layer.wq.dtype
        dh, width = layer.head_dim, layer.w_raw.shape[1] if layer.w_raw is not None else 0
        empty = torch.empty(0, dh, dtype=dtype)
        if entries is None:
            index = torch.empty(0, layer.index_dim, dtype=dtype) if comp.top_k else None
            entries = (empty, empty.clone(), index)
        self.keys, self.values, self.index_keys = entries
        self.tail = torch.empty(0, width, dtype=dtype)
        self.tail_start = tail_start
        self.history_from = history_from

    @property
    def count(self) -> int:
        return int(self.keys.shape[0])

    def entries_before(
        self, position: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The entries whose tokens all lie before ``position`` (what a block-KV cache holds)."""
        n = min(self.count, position // self.comp.ratio)
        index = None if self.index_keys is None else self.index_keys[:n]
        return self.keys[:n], self.values[:n], index

    def extend(self, raw: torch.Tensor, start: int) -> None:
        """Add raw rows for positions ``[start, start+n)`` and pool every entry they complete."""
        if start != self.tail_start + self.tail.shape[0]:
            raise InvalidArgument(
                "start", f"compressed tail holds up to {self.tail_start + self.tail.shape[0]}"
            )
        self.tail = torch.cat([self.tail, raw])
        stop = (start + raw.shape[0]) // self.comp.ratio
        chunk = 8192  # bounds the [entries, window, width] gather at long prefixes
        for first in range(self.count, stop, chunk):
            last = min(stop, first + chunk)
            k, v, ik = self.layer.compress(
                self.tail, self.tail_start, first, last, self.history_from
            )
            self.keys = torch.cat([self.keys, k])
            self.values = torch.cat([self.values, v])
            if ik is not None and self.index_keys is not None:
                self.index_keys = torch.cat([self.index_keys, ik])
        keep = self.comp.window
        if self.tail.shape[0] > keep:
            drop = self.tail.shape[0] - keep
            self.tail = self.tail[drop:].clone()
            self.tail_start += drop

    def select(self, index_q: torch.Tensor | None, qpos: torch.Tensor) -> PickedEntries | None:
        """The entries each query of a block attends to (None when no entry is visible yet)."""
        visible = torch.clamp((qpos + 1) // self.comp.ratio, max=self.count)
        cmax = int(visible.max()) if visible.numel() else 0
        if cmax == 0:
            return None
        columns = torch.arange(cmax)
        if not self.comp.top_k:
            allowed = columns[None, :] < visible[:, None]
            return PickedEntries(self.keys[:cmax], self.values[:cmax], allowed)
        assert index_q is not None and self.index_keys is not None
        # Indexer scores in fp32 so a bf16 run does not pick among spurious ties.
        iscores = index_q.float() @ self.index_keys[:cmax].float().T
        # Only the last few columns differ in visibility across one block of queries.
        vmin = int(visible.min())
        tail = columns[vmin:]
        iscores[:, vmin:] = iscores[:, vmin:].masked_fill(
            tail[None, :] >= visible[:, None], -math.inf
        )
        top = iscores.topk(min(self.comp.top_k, cmax), dim=1).indices
        allowed = top < visible[:, None]
        return PickedEntries(self.keys[top], self.values[top], allowed)


@dataclass
class LayerContext:
    swa: SwaKeyStore
    compressed: CompressedKV | None


class Stack:
    """A sequence of layers run over one chunk of positions."""

    def __init__(self, layers: list[Layer], query_block: int) -> None:
        self.layers = layers
        self.query_block = query_block

    def forward(
        self, x: torch.Tensor, start: int, contexts: list[LayerContext], lo: int = 0
    ) -> torch.Tensor:
        if len(contexts) != len(self.layers):
            raise InvalidArgument("contexts", f"need {len(self.layers)}, got {len(contexts)}")
        for layer, context in zip(self.layers, contexts, strict=True):
            x = layer.forward(x, start, context, lo, self.query_block)
        return x


class V4Model:
    """Embedding, a stack of V4-style layers, final norm and LM head."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32) -> None:
        gen = torch.Generator().manual_seed(config.seed)
        self.config = config
        self.dtype = dtype
        self.embedding = _normal(gen, (config.vocab, config.d_model), 1.0).to(dtype)
        layers = [Layer(kind, config, gen).cast(dtype) for kind in config.layer_kinds]
        self.stack = Stack(layers, config.query_block)
        self.final_norm = torch.ones(config.d_model, dtype=dtype)
        head = _normal(gen, (config.d_model, config.vocab), 1.0 / math.sqrt(config.d_model))
        self.head = head.to(dtype)

    @property
    def layers(self) -> list[Layer]:
        return self.stack.layers

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embedding[tokens]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # Logits in fp32, as engines sample from: a bf16 run then shows its hidden-state
        # differences, not only the rounding of the last matmul's output.
        return (rmsnorm(hidden, self.final_norm) @ self.head).float()

    def forward(
        self, tokens: torch.Tensor, start: int, contexts: list[LayerContext], lo: int = 0
    ) -> torch.Tensor:
        """Final hidden states for ``tokens`` at positions ``[start, start+n)``."""
        return self.stack.forward(self.embed(tokens), start, contexts, lo)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + 1e-6)
    return normed.to(x.dtype) * weight


def _rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotary embedding on ``x [n, heads, dim]`` at absolute ``positions`` (computed in fp32)."""
    half = x.shape[-1] // 2
    freqs = 10000.0 ** (-torch.arange(half, dtype=torch.float32) / half)
    angles = positions.to(torch.float32)[:, None] * freqs[None, :]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    xf = x.float()
    a, b = xf[..., :half], xf[..., half:]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1).to(x.dtype)
