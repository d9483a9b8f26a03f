"""Decoder-side bounded replay on an encoder/decoder (CED) split.

The encoder is a stack of V4-style layers that prefill the whole prompt. Each decoder layer's
global KV (its block KV) is *projected* from the encoder's last hidden state (pooled 4:1), so
only the decoder's own SWA keys need decoder compute. Decoder layer 0 reads the encoder's last
hidden state, so decoder layer d's SWA keys at ``[L-128, L)`` depend on decoder inputs back to
``L - 128 - 127*d``: an exact rebuild runs the decoder over the last ``128 x D`` tokens (the
article: 20 layers x 2,560 tokens); bounded replay runs it over the last 128 only (20 x 128),
its output used for this request's decode and never cached. This module measures both against
a decoder run over the whole prompt.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from kvstore.errors import ConfigError
from kvstore.verify.kvstores import LinearKV
from kvstore.verify.measures import Diff, best_wall, diff
from kvstore.verify.model import WINDOW, CompressedKV, LayerContext, ModelConfig, V4Model, rmsnorm
from kvstore.verify.sequence import fresh_contexts, swa_window

Entries = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]


@dataclass(frozen=True)
class CEDConfig:
    encoder_kinds: tuple[str, ...] = ("swa", "swa", *(("csa", "hca") * 9))
    decoder_layers: int = 20
    prompt_len: int = 4096
    score_gain: float = 4.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.decoder_layers < 1:
            raise ConfigError("decoder_layers", f"must be >= 1, got {self.decoder_layers}")
        if self.prompt_len % WINDOW or self.prompt_len < WINDOW * self.decoder_layers:
            raise ConfigError(
                "prompt_len",
                f"must be a multiple of {WINDOW} and >= {WINDOW} x decoder layers "
                f"= {WINDOW * self.decoder_layers}, got {self.prompt_len}",
            )

    @property
    def exact_span(self) -> int:
        """Decoder tokens an exact rebuild runs (the article's 2,560 for 20 layers)."""
        return WINDOW * self.decoder_layers


class CEDModel:
    def __init__(self, config: CEDConfig) -> None:
        self.config = config
        self.encoder = V4Model(
            ModelConfig(
                layer_kinds=config.encoder_kinds, score_gain=config.score_gain, seed=config.seed
            )
        )
        # The decoder's weights come from their own seed; only its layers and head are used.
        self.decoder = V4Model(
            ModelConfig(
                layer_kinds=("xdec",) * config.decoder_layers,
                score_gain=config.score_gain,
                seed=config.seed + 1,
            )
        )

    def encode(self, tokens: torch.Tensor) -> torch.Tensor:
        """Encoder prefill of the whole prompt: its last hidden state ``[L, d]``."""
        return self.encoder.forward(tokens, 0, fresh_contexts(self.encoder))

    def global_kv(self, encoder_out: torch.Tensor) -> list[Entries]:
        """Every decoder layer's global KV, projected (and pooled 4:1) from the encoder."""
        out = []
        for layer in self.decoder.layers:
            assert layer.compressor is not None
            raw = layer.raw_rows(rmsnorm(encoder_out, layer.norm1))
            out.append(layer.compress(raw, 0, 0, encoder_out.shape[0] // layer.compressor.ratio))
        return out

    def decode_from(
        self, encoder_out: torch.Tensor, global_kv: list[Entries], start: int
    ) -> tuple[list[LayerContext], torch.Tensor]:
        """Run the decoder over ``[start, L)`` with windows truncated at ``start``; returns its
        contexts and the next-token logits (last position)."""
        contexts = []
        for layer, entries in zip(self.decoder.layers, global_kv, strict=True):
            compressed = CompressedKV(layer, start, entries)
            contexts.append(LayerContext(LinearKV(start, layer.window), compressed))
        hidden = self.decoder.stack.forward(encoder_out[start:], start, contexts, lo=start)
        return contexts, self.decoder.logits(hidden[-1:])[0]


@dataclass(frozen=True)
class DecoderRebuild:
    method: str
    start: int
    decoder_tokens: int  # decoder token-layers run
    prefill_tokens: int  # encoder + decoder token-layers for the whole prefill
    wall_s: float  # decoder part only
    layer_errors: tuple[float, ...]
    next_token: Diff
    same_top1: bool

    def as_dict(self) -> dict[str, object]:
        return {
            "method": self.method,
            "decoder_start": self.start,
            "decoder_token_layers": self.decoder_tokens,
            "prefill_token_layers": self.prefill_tokens,
            "decoder_wall_s": self.wall_s,
            "layer_rel_l2": list(self.layer_errors),
            "next_token_logits": self.next_token.as_dict(),
            "same_top1": self.same_top1,
        }


def run_ced(config: CEDConfig | None = None) -> list[DecoderRebuild]:
    """Full decoder prefill (the reference), exact rebuild, bounded replay."""
    config = config or CEDConfig()
    model = CEDModel(config)
    gen = torch.Generator().manual_seed(config.seed + 3)
    n = config.prompt_len
    tokens = torch.randint(0, model.encoder.config.vocab, (n,), generator=gen)
    enc_layers, dec_layers = len(config.encoder_kinds), config.decoder_layers
    with torch.inference_mode():
        encoder_out = model.encode(tokens)
        global_kv = model.global_kv(encoder_out)
        rows = []
        reference: tuple[list[torch.Tensor], torch.Tensor] | None = None
        plans = [
            ("full decoder prefill", 0),
            (f"exact rebuild ({dec_layers} x {config.exact_span})", n - config.exact_span),
            (f"bounded replay ({dec_layers} x {WINDOW})", n - WINDOW),
        ]
        for method, start in plans:
            wall, (contexts, logits) = best_wall(
                (n - start) * dec_layers,
                partial(model.decode_from, encoder_out, global_kv, start),
            )
            window = swa_window(contexts, n, WINDOW)
            if reference is None:
                reference = (window, logits)
            errors = tuple(
                diff(got, want).rel_l2 for got, want in zip(window, reference[0], strict=True)
            )
            rows.append(
                DecoderRebuild(
                    method=method,
                    start=start,
                    decoder_tokens=(n - start) * dec_layers,
                    prefill_tokens=n * enc_layers + (n - start) * dec_layers,
                    wall_s=wall,
                    layer_errors=errors,
                    next_token=diff(logits, reference[1]),
                    same_top1=int(logits.argmax()) == int(reference[1].argmax()),
                )
            )
    return rows
