#!/usr/bin/env python3
"""PyTorch baseline for head training: the same head, loss, optimizer and batches as
`headway-train eagle|medusa`, timed on the same machine.

Reads a Headway feature directory as the trainer's first epoch does (the very batches:
scripts/headway_features.py) and runs `--steps` optimizer updates of:

- EAGLE: fc(concat(s * embed(t[i+1]), f[i])) -> one transformers LlamaDecoderLayer without its input
  norm -> f_hat; loss SmoothL1(f_hat, f) + 0.1 * soft-CE against the frozen LM head; uniform
  feature noise +-0.1; s is `--embed-scale` (auto, as headway-train's default: the RMS of the
  target's final norm weight over that of its embedding);
- Medusa: K heads of ResBlocks x + SiLU(Wx + b) with their own LM-head copies; loss
  sum_k 0.8^k CE_k on assistant tokens k + 2 ahead.

AdamW (0.9, 0.95), gradient clipping at 0.5, f32, `torch.set_num_threads(--threads)`. With
`--headway-json` (written by `headway-train ... --json`) it prints both sides and their ratio.

Usage::

    python scripts/bench_train_torch.py --head eagle --features DIR --steps 30 \\
        --headway-json train-eagle.json
"""

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from headway_features import batches, most_frequent_assistant_tokens

class Eagle(torch.nn.Module):
    def __init__(self, config, embed, lm_head, embed_scale):
        super().__init__()
        h = config.hidden_size
        self.embed_scale = embed_scale
        layer_config = AutoConfig.for_model(**{**config.to_dict(), "num_hidden_layers": 1})
        layer_config._attn_implementation = "sdpa"
        self.fc = torch.nn.Linear(2 * h, h)
        self.layer = LlamaDecoderLayer(layer_config, layer_idx=0)
        self.layer.input_layernorm = torch.nn.Identity()
        self.rotary = LlamaRotaryEmbedding(layer_config)
        self.register_buffer("embed", embed)
        self.register_buffer("lm_head", lm_head)

    def loss(self, ids, mask, hidden):
        b, t = ids.shape
        inputs = hidden[:, :-1] + (torch.rand_like(hidden[:, :-1]) * 0.2 - 0.1)
        x = self.fc(torch.cat([self.embed[ids[:, 1:]] * self.embed_scale, inputs], -1))
        positions = torch.arange(t - 1).expand(b, t - 1)
        out = self.layer(x, attention_mask=None, position_ids=positions, position_embeddings=self.rotary(x, positions))
        predicted = out[0] if isinstance(out, tuple) else out
        valid = mask[:, 1:]
        predicted, target = predicted[valid], hidden[:, 1:][valid]
        regression = F.smooth_l1_loss(predicted, target)
        with torch.no_grad():
            target_probs = (target @ self.lm_head.T).softmax(-1)
        classification = -(target_probs * (predicted @ self.lm_head.T).log_softmax(-1)).sum(-1).mean()
        return regression + 0.1 * classification


class Medusa(torch.nn.Module):
    def __init__(self, heads, layers, lm_head, d2t, vocab):
        super().__init__()
        h = lm_head.shape[1]
        self.blocks = torch.nn.ModuleList(
            torch.nn.ModuleList(torch.nn.Linear(h, h) for _ in range(layers)) for _ in range(heads)
        )
        for head in self.blocks:
            for block in head:
                torch.nn.init.zeros_(block.weight)
                torch.nn.init.zeros_(block.bias)
        self.lm_heads = torch.nn.ParameterList(torch.nn.Parameter(lm_head.clone()) for _ in range(heads))
        table = torch.full((vocab,), -1, dtype=torch.long)
        table[d2t] = torch.arange(len(d2t))
        self.register_buffer("to_draft", table)

    def loss(self, ids, mask, hidden):
        total = 0.0
        for k, (blocks, lm_head) in enumerate(zip(self.blocks, self.lm_heads)):
            shift = k + 2
            targets = self.to_draft[ids[:, shift:]]
            valid = mask[:, shift:] & (targets >= 0)
            x = hidden[:, :-shift][valid]
            for block in blocks:
                x = x + F.silu(block(x))
            total = total + 0.8**k * F.cross_entropy(x @ lm_head.T, targets[valid])
        return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--head", choices=["eagle", "medusa"], required=True)
    parser.add_argument("--features", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch-tokens", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--medusa-heads", type=int, default=4)
    parser.add_argument("--draft-vocab", type=int, default=None, help="Medusa: N most frequent assistant tokens")
    parser.add_argument("--headway-json", type=Path, default=None)
    parser.add_argument("--embed-scale", default="auto", help="EAGLE: factor on the embedding before fc, or auto")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    manifest = json.loads((args.features / "manifest.json").read_text())
    target = manifest["settings"]["target"]["dir"]
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    lm_head = model.lm_head.weight.detach().clone()
    if args.head == "eagle":
        embed = model.model.embed_tokens.weight.detach().clone()
        if args.embed_scale == "auto":
            rms = lambda t: t.float().square().mean().sqrt().item()
            embed_scale = rms(model.model.norm.weight) / rms(embed)
        else:
            embed_scale = float(args.embed_scale)
        head = Eagle(model.config, embed, lm_head, embed_scale)
    else:
        vocab = lm_head.shape[0]
        d2t = torch.arange(vocab)
        if args.draft_vocab:
            d2t = most_frequent_assistant_tokens(args.features, args.draft_vocab, vocab)
        head = Medusa(args.medusa_heads, 1, lm_head[d2t], d2t, vocab)
    del model
    optimizer = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=1e-4, betas=(0.9, 0.95), weight_decay=0.0)

    stream = batches(args.features, args.seed, args.batch_tokens)
    tokens, start = 0, time.perf_counter()
    for step in range(args.steps):
        batch = next(stream)
        loss = head.loss(batch["ids"], batch["loss_mask"], batch["hidden"])
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 0.5)
        optimizer.step()
        tokens += batch["tokens"]
    seconds = time.perf_counter() - start
    rate = tokens / seconds
    print(f"PyTorch {torch.__version__} {args.head}, {args.threads} threads: {args.steps} steps, {tokens} tokens in {seconds:.1f} s = {rate:.0f} tokens/s (last loss {loss.item():.3f})")
    if args.headway_json:
        headway = json.loads(args.headway_json.read_text())
        assert headway["tokens"] == tokens, f"Headway trained on {headway['tokens']} tokens, PyTorch on {tokens}: other batches"
        print(f"Headway: {headway['tokens_per_s']:.0f} tokens/s; {headway['tokens_per_s'] / rate:.2f}x PyTorch")


if __name__ == "__main__":
    main()
