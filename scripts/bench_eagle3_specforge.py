#!/usr/bin/env python3
"""SpecForge's EAGLE-3 training on Headway's features: the peer of `make bench-eagle3`.

Trains SpecForge's own EAGLE-3 step — its `LlamaForCausalLMEagle3` draft model, `OnlineEagle3Model`
(training-time test), `Eagle3TrainStrategy` with the offline compact teacher (the target's LM head
over the stored final hidden states) and its `BF16Optimizer` (AdamW over f32 masters, clipping,
warm-up then cosine) — on the very batches `headway-train eagle3` trains on (same feature
directory, seed and padded-token packing: scripts/headway_features.py), and writes the head as
SpecForge's checkpoint filter keeps it (`model.safetensors` without the embedding, `config.json`),
which `headway-train import --format eagle3` reads so both heads are scored by the same `eval`.

Three workarounds a CPU user of SpecForge 0.2.0 needs, each the smallest that runs its code:
- its loss is a Triton kernel (`LogSoftmaxLoss`), which cannot take CPU tensors: replaced by the
  same formula in plain PyTorch (SpecForge's own reference `_compute_loss` in
  specforge/core/loss.py);
- its target-head and embedding loaders want a `*.index.json` beside the target's weights: a
  directory of links to the target's files plus a one-file index is made for them;
- the stock trainer casts the teacher head to bf16; here it stays in `--dtype` (f32 by default,
  Headway's CPU default), as does the draft model.
Feature capture (SpecForge's needs SGLang and CUDA) is not needed: the features are Headway's.

Usage::

    python scripts/bench_eagle3_specforge.py train --features DIR --steps 30 --out DIR --json FILE
    python scripts/bench_eagle3_specforge.py report --headway H.json --specforge S.json \
        --specforge-eval E.json [--rerun H2.json S2.json]

`report` prints the held-out accuracies per draft position of both heads (Headway's from
`headway-train eagle3 --json`, SpecForge's from `headway-train eval --json` on its imported head)
and both training rates, with any repeated throughput runs beside them.
"""

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig

import specforge.algorithms.eagle3.model as eagle3_model
from specforge.algorithms.eagle3.model import OnlineEagle3Model
from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3
from specforge.modeling.target.target_head import TargetHead
from specforge.optimizer import BF16Optimizer
from specforge.runtime.contracts import TrainBatch
from specforge.training.strategies.base import Eagle3TrainStrategy

from headway_features import batches, manifest, most_frequent_assistant_tokens


class PlainLogSoftmaxLoss:
    """SpecForge's soft cross-entropy in plain PyTorch (its Triton kernel needs CUDA tensors):
    -mean over rows of sum_v mask * p_target(v) * log_softmax(logits)(v)."""

    @staticmethod
    def apply(logits, target_p, position_mask):
        log_p = torch.log_softmax(logits.float(), dim=2)
        return -torch.sum(position_mask * target_p * log_p, 2).mean()


def indexed_target(target: Path, scratch: Path) -> tuple[Path, str]:
    """A directory SpecForge's loaders accept for `target`: links to its files and a one-file
    `model.safetensors.index.json`. Returns it and the LM head's tensor name (the embedding's
    when the target ties them)."""
    for entry in target.iterdir():
        os.symlink(entry.resolve(), scratch / entry.name)
    names = list(load_file(str(target / "model.safetensors")).keys())
    index = {"metadata": {}, "weight_map": {name: "model.safetensors" for name in names}}
    (scratch / "model.safetensors.index.json").write_text(json.dumps(index))
    lm_head = "lm_head.weight" if "lm_head.weight" in names else "model.embed_tokens.weight"
    return scratch, lm_head


def draft_config(target: Path, features: Path, draft_vocab: int) -> LlamaConfig:
    config = LlamaConfig.from_pretrained(target)
    config.architectures = ["LlamaForCausalLMEagle3"]
    config.num_hidden_layers = 1
    config.draft_vocab_size = draft_vocab
    config.tie_word_embeddings = False
    # SpecForge numbers a tap by the decoder layer whose output it is: Headway's tap k (the
    # stream after k layers) is its layer k - 1.
    taps = manifest(features)["settings"]["taps"]
    config.eagle_config = {"eagle_aux_hidden_state_layer_ids": [k - 1 for k in taps]}
    return config


def vocab_mapping(features: Path, draft_vocab: int, vocab: int):
    """d2t/t2d by SpecForge's rule (`process_token_dict_to_mappings`, which cannot be imported
    without HF `datasets`): the `draft_vocab` most frequent assistant tokens of the training
    split, ascending; d2t[i] = id_i - i, t2d marks them."""
    used = most_frequent_assistant_tokens(features, draft_vocab, vocab).sort().values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[used] = True
    return used - torch.arange(draft_vocab), t2d


def train_batch(batch: dict) -> TrainBatch:
    """SpecForge's offline sample layout, collated: its normaliser zeroes each sequence's last
    loss position."""
    loss_mask = batch["loss_mask"].long()
    loss_mask[torch.arange(len(batch["lengths"])), batch["lengths"] - 1] = 0
    attention_mask = torch.arange(batch["ids"].shape[1])[None, :] < batch["lengths"][:, None]
    return TrainBatch(
        sample_ids=[str(i) for i in range(len(batch["lengths"]))],
        strategy="eagle3",
        tensors={
            "input_ids": batch["ids"],
            "attention_mask": attention_mask.long(),
            "loss_mask": loss_mask,
            "hidden_state": batch["taps"],
            "target": batch["hidden"],
        },
        metadata={"target_repr": "hidden_state"},
    )


def train(args) -> None:

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    dtype = getattr(torch, args.dtype)
    eagle3_model.LogSoftmaxLoss = PlainLogSoftmaxLoss
    target = Path(manifest(args.features)["settings"]["target"]["dir"])
    config = draft_config(target, args.features, args.draft_vocab)
    d2t, t2d = vocab_mapping(args.features, args.draft_vocab, config.vocab_size)

    with tempfile.TemporaryDirectory() as scratch:
        indexed, lm_head_key = indexed_target(target, Path(scratch))
        draft = LlamaForCausalLMEagle3(config, attention_backend="sdpa")
        draft.load_embedding(str(indexed), embedding_key="model.embed_tokens.weight")
        teacher = TargetHead.from_pretrained(str(indexed), lm_head_key=lm_head_key)
    draft.freeze_embedding()
    draft.d2t.copy_(d2t)
    draft.t2d.copy_(t2d)
    teacher.freeze_weights()
    model = OnlineEagle3Model(draft, length=args.ttt, attention_backend="sdpa").to(dtype)
    teacher = teacher.to(dtype).eval()
    strategy = Eagle3TrainStrategy(model, target_head=teacher, ploss_decay=args.decay, compact_teacher=True)
    optimizer = BF16Optimizer(
        model, lr=args.lr, max_grad_norm=0.5, total_steps=args.steps, warmup_ratio=args.warmup / args.steps
    )

    stream = batches(args.features, args.seed, args.batch_tokens)
    tokens, seconds = 0, 0.0
    for step in range(1, args.steps + 1):
        batch = next(stream)
        start = time.perf_counter()
        output = strategy.forward_loss(train_batch(batch))
        output.loss.backward()
        optimizer.step()
        seconds += time.perf_counter() - start
        tokens += batch["tokens"]
        accuracies = " ".join(f"acc_{k} {a.item():.3f}" for k, a in enumerate(output.metrics["acces"]))
        print(f"step {step}/{args.steps}: {accuracies} loss {output.loss.item():.3f} | {tokens / seconds:.0f} tok/s", flush=True)

    args.out.mkdir(parents=True, exist_ok=True)
    state = strategy.checkpoint_state_filter(model.state_dict())
    save_file({k: v.float().contiguous() for k, v in state.items()}, str(args.out / "model.safetensors"))
    (args.out / "config.json").write_text(json.dumps(config.to_dict(), indent=2) + "\n")
    rate = tokens / seconds
    print(f"SpecForge EAGLE-3 ({args.dtype}, {args.threads} threads): {args.steps} steps, {tokens} tokens in {seconds:.1f} s = {rate:.0f} tokens/s; head in {args.out}")
    if args.json:
        figures = {"steps": args.steps, "tokens": tokens, "seconds": seconds, "tokens_per_s": rate, "dtype": args.dtype}
        args.json.write_text(json.dumps(figures, indent=2) + "\n")


def report(args) -> None:
    headway = json.loads(args.headway.read_text())
    specforge = json.loads(args.specforge.read_text())
    scored = json.loads(args.specforge_eval.read_text())["held_out"]
    if headway["tokens"] != specforge["tokens"]:
        raise SystemExit(f"Headway trained on {headway['tokens']} tokens, SpecForge on {specforge['tokens']}: other batches")
    rounds = sorted(k for k in headway["held_out"] if k.startswith("acc_"))
    print(f"EAGLE-3 on the same features and batches: {headway['steps']} steps, {headway['tokens']} tokens each")
    print("| held-out | " + " | ".join(rounds) + " |")
    print("|---|" + "---|" * len(rounds))
    for name, figures in (("Headway", headway["held_out"]), ("SpecForge", scored)):
        print(f"| {name} | " + " | ".join(f"{figures[k]:.3f}" for k in rounds) + " |")
    runs = [(headway, specforge)]
    if args.rerun:
        runs.append(tuple(json.loads(Path(p).read_text()) for p in args.rerun))
    for i, (h, s) in enumerate(runs):
        ratio = h["tokens_per_s"] / s["tokens_per_s"]
        print(f"training run {i + 1}: Headway {h['tokens_per_s']:.0f} tokens/s, SpecForge {s['tokens_per_s']:.0f} tokens/s ({s['dtype']}): {ratio:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    trainer = commands.add_parser("train", help="train SpecForge's EAGLE-3 on Headway's features")
    trainer.add_argument("--features", type=Path, required=True)
    trainer.add_argument("--out", type=Path, required=True, help="where the trained head is written")
    trainer.add_argument("--steps", type=int, default=30)
    trainer.add_argument("--batch-tokens", type=int, default=2048)
    trainer.add_argument("--seed", type=int, default=0)
    trainer.add_argument("--threads", type=int, default=2)
    trainer.add_argument("--lr", type=float, default=1e-3)
    trainer.add_argument("--warmup", type=int, default=2, help="warm-up steps (SpecForge takes a ratio)")
    trainer.add_argument("--ttt", type=int, default=7)
    trainer.add_argument("--decay", type=float, default=0.8)
    trainer.add_argument("--draft-vocab", type=int, default=8192)
    trainer.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    trainer.add_argument("--json", type=Path, default=None)
    reporter = commands.add_parser("report", help="both heads side by side")
    reporter.add_argument("--headway", type=Path, required=True, help="headway-train eagle3 --json")
    reporter.add_argument("--specforge", type=Path, required=True, help="this script's train --json")
    reporter.add_argument("--specforge-eval", type=Path, required=True, help="headway-train eval --json of its head")
    reporter.add_argument("--rerun", nargs=2, metavar=("HEADWAY", "SPECFORGE"), help="a second pair of throughput runs")
    args = parser.parse_args()
    train(args) if args.command == "train" else report(args)


if __name__ == "__main__":
    main()
