#!/usr/bin/env python3
"""Regenerate ``fixtures/architectures/``: tiny random models of every architecture the runtime
supports, with transformers' logits for one input, so the Rust forward pass is checked against
the reference implementation beyond SmolLM2 (Llama-3 rope scaling, untied embeddings, Mistral,
Qwen2's q/k/v bias, Qwen3's q/k norms and explicit head_dim).

Each ``fixtures/architectures/<name>/`` holds ``config.json`` and ``model.safetensors`` as
``save_pretrained`` writes them, and ``reference.safetensors`` with ``input_ids`` (int64 [T]),
``position_ids`` (int64 [T], offset to exercise rotary frequencies at larger positions) and
``logits`` (f32 [T, vocab]). Only needed to regenerate the fixtures; the Rust test
(``model/tests/architectures.rs``) reads the committed files.

Usage (from the repository root)::

    ~/.cache/headway/venv/bin/python scripts/make_architecture_fixtures.py
"""

import argparse
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
)
LLAMA3_SCALING = dict(
    rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
    original_max_position_embeddings=64,
)

MODELS = {
    "llama3_rope_scaling": (LlamaForCausalLM, LlamaConfig(
        **COMMON, rope_theta=500000.0, rope_scaling=LLAMA3_SCALING, tie_word_embeddings=True)),
    "llama_untied": (LlamaForCausalLM, LlamaConfig(**COMMON, tie_word_embeddings=False)),
    "mistral": (MistralForCausalLM, MistralConfig(**COMMON, sliding_window=None, tie_word_embeddings=False)),
    "qwen2": (Qwen2ForCausalLM, Qwen2Config(**COMMON, tie_word_embeddings=True)),
    "qwen3": (Qwen3ForCausalLM, Qwen3Config(**COMMON, head_dim=32, tie_word_embeddings=True)),
}


def randomise(model: torch.nn.Module) -> None:
    """Replace transformers' init (norms at exactly 1, biases at 0) with values that make every
    parameter matter, so a misplaced norm or bias changes the logits."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            else:
                param.copy_(0.15 * torch.randn_like(param))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "fixtures" / "architectures")
    args = parser.parse_args()
    torch.set_num_threads(2)
    for name, (model_class, config) in MODELS.items():
        torch.manual_seed(0)
        model = model_class(config).eval()
        randomise(model)
        out = args.out / name
        model.save_pretrained(out, safe_serialization=True)
        # transformers 5 also writes generation defaults, which no test reads.
        (out / "generation_config.json").unlink(missing_ok=True)
        input_ids = torch.randint(3, config.vocab_size, (12,))
        position_ids = torch.arange(100, 112)
        with torch.no_grad():
            logits = model(input_ids[None], position_ids=position_ids[None]).logits[0]
        save_file(
            {"input_ids": input_ids, "position_ids": position_ids, "logits": logits.contiguous()},
            str(out / "reference.safetensors"),
        )
        print(f"{name}: {sum(p.numel() for p in model.parameters())} parameters -> {out}")


if __name__ == "__main__":
    main()
