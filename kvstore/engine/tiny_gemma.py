"""A tiny random-weight Gemma-3 (text only): sliding-window and full-attention layers alternate.

``tiny_model.build_tiny_llama`` gives the connector tests a dense model (one KV cache group).
A hybrid model is what makes vLLM's hybrid KV cache manager split the cache into a full-attention
group and a sliding-window group, so the connector's hybrid path needs one too, built locally
like the Llama: ``build_tiny_gemma3`` writes a Hugging Face directory (``config.json``,
safetensors weights, tokenizer files) for ``Gemma3ForCausalLM`` (``model_type`` "gemma3_text"),
float32, random but fixed by ``seed``. Gemma-3 RMS-normalises queries and keys, so scaling the
projections does not sharpen attention; the norms' gains and a small ``query_pre_attn_scalar``
do, so that attention (and hence the logprobs) depends visibly on which KV it reads.

    python -m kvstore.engine.tiny_gemma DIR [--layers 4 --sliding-window 128]
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvstore.engine.tiny_model import shape_cli, write_model
from kvstore.errors import InvalidArgument


@dataclass(frozen=True)
class TinyGemma3:
    """Shapes of the model: layer ``i`` is sliding-window attention for even ``i``, full
    attention for odd ``i`` (4 layers → 2 of each; one 128-token block of one layer's KV is
    2 × 2 × 32 × 128 × 4 B = 64 KiB in float32)."""

    layers: int = 4
    hidden: int = 128
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 32
    intermediate: int = 256
    vocab: int = 1024
    sliding_window: int = 128
    max_positions: int = 4096
    seed: int = 0

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            least = 0 if name == "seed" else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise InvalidArgument(name, f"must be an integer >= {least}, got {value!r}")
        if self.heads % self.kv_heads:
            raise InvalidArgument("heads", "heads must divide by kv_heads")

    @property
    def layer_types(self) -> list[str]:
        kinds = ("sliding_attention", "full_attention")
        return [kinds[i % 2] for i in range(self.layers)]


def build_tiny_gemma3(directory: str | Path, shape: TinyGemma3 | None = None) -> Path:
    """Write the model and its tokenizer into ``directory`` (created); returns it."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    shape = shape or TinyGemma3()

    def init(name: str, parameter: Any) -> None:
        if name.endswith(("q_norm.weight", "k_norm.weight")):
            parameter.fill_(1.0)  # Gemma norms scale by 1 + weight: gain 2 on q and k
        elif name.endswith("norm.weight"):
            parameter.zero_()
        elif "embed_tokens" in name:  # Gemma multiplies embeddings by √hidden
            parameter.normal_(0.0, 1.0 / shape.hidden**0.5)
        else:
            parameter.normal_(0.0, 0.08)

    return write_model(
        directory,
        shape,
        "gemma3",
        Gemma3TextConfig,
        Gemma3ForCausalLM,
        init,
        sliding_window=shape.sliding_window,
        layer_types=shape.layer_types,
        query_pre_attn_scalar=shape.head_dim // 4,  # scale 2/√head_dim: sharper attention
        pad_token_id=1,
        dtype="float32",
    )


def main(argv: list[str] | None = None) -> int:
    path, shape = shape_cli(
        argv, "kvstore.engine.tiny_gemma", __doc__, TinyGemma3(), build_tiny_gemma3
    )
    print(f"{path}: {shape} ({shape.layer_types})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
