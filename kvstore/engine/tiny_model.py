"""A tiny random-weight Llama with a byte-level BPE tokenizer trained on the spot.

Tests and benchmarks need a real vLLM engine but can reach no model hub: ``build_tiny_llama``
writes a Hugging Face model directory (``config.json``, safetensors weights, tokenizer files)
that vLLM loads like any downloaded model. The weights are random but fixed by ``seed``, so two
engines given the same directory compute the same KV, which is what a cross-engine cache hit
needs. Needs ``transformers`` and ``tokenizers`` (installed with vLLM).

    python -m kvstore.engine.tiny_model DIR [--layers 2 --hidden 128]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvstore.errors import InvalidArgument
from kvstore.keys import BLOCK_TOKENS


@dataclass(frozen=True)
class TinyLlama:
    """Shapes of the model (the defaults are the connector tests': 2 layers, 4 heads, 2 KV
    heads, head size 32 → one 128-token block of KV is 2 × 2 × 2 × 32 × 128 × 4 B = 128 KiB in
    float32)."""

    layers: int = 2
    hidden: int = 128
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 256
    vocab: int = 1024
    max_positions: int = 4096
    seed: int = 0

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidArgument(name, f"must be a non-negative integer, got {value!r}")
        if self.hidden % self.heads or self.heads % max(self.kv_heads, 1):
            raise InvalidArgument("heads", "hidden must divide by heads, heads by kv_heads")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def block_bytes(self, block_tokens: int = BLOCK_TOKENS, dtype_bytes: int = 4) -> int:
        """Bytes of one block of KV over all layers (K and V)."""
        return self.layers * 2 * self.kv_heads * self.head_dim * block_tokens * dtype_bytes


def _corpus(vocab: int) -> list[str]:
    words = [f"w{i:03d}" for i in range(vocab)]
    return [" ".join(words[j : j + 16]) for j in range(0, len(words), 4)]


def write_tokenizer(out: Path, vocab: int) -> None:
    """A byte-level BPE tokenizer of ``vocab`` tokens trained on the spot, saved into ``out``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(vocab), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(out)


def transformer_shape(shape: Any) -> dict[str, int]:
    """The Hugging Face config fields every tiny model's shape sets the same way."""
    return {
        "vocab_size": shape.vocab,
        "hidden_size": shape.hidden,
        "intermediate_size": shape.intermediate,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "max_position_embeddings": shape.max_positions,
    }


def build_tiny_llama(directory: str | Path, shape: TinyLlama | None = None) -> Path:
    """Write the model and its tokenizer into ``directory`` (created); returns it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    def init(name: str, parameter: Any) -> None:
        # Larger weights than the default init: logits that differ by token.
        parameter.normal_(0.0, 0.08)

    return write_model(
        directory,
        shape or TinyLlama(),
        "llama",
        LlamaConfig,
        LlamaForCausalLM,
        init,
        torch_dtype="float32",
    )


def write_model(
    directory: str | Path,
    shape: Any,
    name: str,
    config_class: Any,
    model_class: Any,
    init: Callable[[str, Any], None],
    **config: Any,
) -> Path:
    """A tiny random model of ``shape`` into ``directory`` (created): its tokenizer, config
    (``transformer_shape`` plus ``config``), weights drawn by ``init`` per parameter from the
    shape's seed, and ``kvstore-tiny-<name>.json`` (the shape)."""
    import torch

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    write_tokenizer(out, shape.vocab)
    settings = {"bos_token_id": 0, "eos_token_id": 1, "tie_word_embeddings": False, **config}
    torch.manual_seed(shape.seed)
    model = model_class(config_class(**transformer_shape(shape), **settings))
    with torch.no_grad():
        for parameter_name, parameter in model.named_parameters():
            init(parameter_name, parameter)
    model.save_pretrained(out, safe_serialization=True)
    (out / f"kvstore-tiny-{name}.json").write_text(json.dumps(asdict(shape)))
    return out


def shape_cli(
    argv: list[str] | None, module: str, doc: str, default: Any, build: Callable[[Path, Any], Path]
) -> tuple[Path, Any]:
    """The command line of a tiny-model module: a directory and one flag per shape field."""
    parser = argparse.ArgumentParser(prog=f"python -m {module}", description=doc.split("\n\n")[0])
    parser.add_argument("directory", type=Path)
    for name, value in asdict(default).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=value)
    args = parser.parse_args(argv)
    shape = type(default)(**{name: getattr(args, name) for name in asdict(default)})
    return build(args.directory, shape), shape


def main(argv: list[str] | None = None) -> int:
    path, shape = shape_cli(
        argv, "kvstore.engine.tiny_model", __doc__, TinyLlama(), build_tiny_llama
    )
    print(f"{path}: {shape} (block {shape.block_bytes()} B in float32)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
