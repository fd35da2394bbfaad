#!/usr/bin/env python3
"""PyTorch baseline for `headway-train prepare`: the same target forward over the same sequences.

Reads the token sequences of a Headway feature directory (its shards' `input_ids` and `offsets`),
batches them exactly as `prepare` does (per shard: longest first, right-padded batches of at most
`--batch-tokens` padded tokens), and runs the transformers model's trunk (`model.model`, whose
output is the final post-norm hidden state) with `torch.inference_mode` on the CPU with a fixed
number of threads. It prints target tokens/s, the useful model FLOP/s, and the machine's matrix
multiply limit measured on the same GEMM shapes; with `--headway-json` (written by
`headway-train prepare --json`) it prints both sides and their ratio.

As a check that both sides compute the same thing it reports the largest difference between its
hidden states (cast to the stored dtype) and the stored features of the first shard, relative to
each sequence's largest stored value.

Usage (from the repository root)::

    ~/.cache/headway/venv/bin/python scripts/bench_prepare_torch.py --features /tmp/features \\
        --headway-json /tmp/prepare.json --threads 2
"""

import argparse
import json
import time
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM


def length_buckets(lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """The batching of Headway's `length_buckets`: longest first (stable), padded budget."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    for i in order:
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= batch_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


def shard_sequences(path: Path) -> tuple[list[torch.Tensor], dict]:
    tensors = load_file(path)
    offsets = tensors["offsets"].tolist()
    ids = tensors["input_ids"].long()
    return [ids[a:b] for a, b in zip(offsets, offsets[1:])], tensors


def useful_flops(config, length: int) -> float:
    """Matrix-multiply FLOPs of the trunk on one sequence of `length` tokens (causal attention
    pairs only; norms and element-wise ops left out)."""
    h, inter = config.hidden_size, config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or h // config.num_attention_heads
    q_dim = config.num_attention_heads * head_dim
    kv_dim = config.num_key_value_heads * head_dim
    linear_params = h * q_dim + 2 * h * kv_dim + q_dim * h + 3 * h * inter
    pairs = length * (length + 1) / 2
    attention = 2 * 2 * config.num_attention_heads * head_dim * pairs
    return config.num_hidden_layers * (2 * length * linear_params + attention)


def gemm_limit(config, rows: int, repeats: int = 5) -> float:
    """Best GFLOP/s of torch.mm on the trunk's GEMM shapes with `rows` rows and on square 2048."""
    h, inter = config.hidden_size, config.intermediate_size
    shapes = [(rows, h, h), (rows, h, 2 * inter), (rows, inter, h), (2048, 2048, 2048)]
    best = 0.0
    for m, k, n in shapes:
        a, b = torch.randn(m, k), torch.randn(k, n)
        torch.mm(a, b)
        start = time.perf_counter()
        for _ in range(repeats):
            torch.mm(a, b)
        seconds = (time.perf_counter() - start) / repeats
        best = max(best, 2 * m * k * n / seconds / 1e9)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--features", type=Path, required=True, help="feature directory made by prepare")
    parser.add_argument("--target", type=Path, default=None, help="target directory (default: the manifest's)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--headway-json", type=Path, default=None, help="`headway-train prepare --json` output")
    parser.add_argument("--json", type=Path, default=None, help="write the figures to this JSON file")
    args = parser.parse_args()

    manifest = json.loads((args.features / "manifest.json").read_text())
    settings = manifest["settings"]
    batch_tokens = settings["batch_tokens"]
    target = args.target or Path(settings["target"]["dir"])
    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    trunk = model.model

    tokens = padded = 0
    flops = 0.0
    max_diff = None
    seconds = 0.0
    with torch.inference_mode():
        for shard_index, shard in enumerate(manifest["shards"]):
            sequences, stored = shard_sequences(args.features / shard["file"])
            lengths = [len(s) for s in sequences]
            offsets = stored["offsets"].tolist()
            for batch in length_buckets(lengths, batch_tokens):
                longest = lengths[batch[0]]
                ids = torch.zeros(len(batch), longest, dtype=torch.long)
                for row, i in enumerate(batch):
                    ids[row, : lengths[i]] = sequences[i]
                start = time.perf_counter()
                hidden = trunk(input_ids=ids).last_hidden_state
                seconds += time.perf_counter() - start
                tokens += sum(lengths[i] for i in batch)
                padded += ids.numel()
                flops += sum(useful_flops(model.config, lengths[i]) for i in batch)
                if shard_index == 0:
                    for row, i in enumerate(batch):
                        want = stored["hidden"][offsets[i] : offsets[i + 1]].float()
                        got = hidden[row, : lengths[i]].to(stored["hidden"].dtype).float()
                        diff = ((want - got).abs().max() / want.abs().max()).item()
                        max_diff = diff if max_diff is None else max(max_diff, diff)
            print(f"{shard['file']}: {tokens} tokens so far, {tokens / seconds:.0f} tokens/s", flush=True)

    limit = gemm_limit(model.config, batch_tokens)
    result = {
        "torch": torch.__version__,
        "threads": args.threads,
        "sequences": manifest["counts"]["sequences"],
        "tokens": tokens,
        "padded_tokens": padded,
        "batch_tokens": batch_tokens,
        "pytorch_seconds": seconds,
        "pytorch_tokens_per_s": tokens / seconds,
        "pytorch_gflops": flops / seconds / 1e9,
        "gemm_limit_gflops": limit,
        "max_rel_diff_vs_stored_first_shard": max_diff,
        "stored_dtype": settings["dtype"],
    }
    print(
        f"PyTorch {torch.__version__}, {args.threads} threads: {tokens} tokens in {seconds:.1f} s = "
        f"{result['pytorch_tokens_per_s']:.0f} tokens/s, {result['pytorch_gflops']:.0f} GFLOP/s useful "
        f"({100 * result['pytorch_gflops'] / limit:.0f}% of the {limit:.0f} GFLOP/s GEMM limit); "
        f"padding {100 * (padded - tokens) / padded:.1f}%; max |diff| / max |stored| (first shard) {max_diff:.2e}"
    )
    if args.headway_json:
        headway = json.loads(args.headway_json.read_text())
        assert headway["tokens_extracted"] == tokens, "the Headway run extracted other sequences"
        rate = headway["tokens_extracted"] / headway["extraction_seconds"]
        gflops = flops / headway["extraction_seconds"] / 1e9
        result.update(
            headway_seconds=headway["extraction_seconds"],
            headway_tokens_per_s=rate,
            headway_gflops=gflops,
            speedup=rate / result["pytorch_tokens_per_s"],
        )
        print(
            f"Headway: {rate:.0f} tokens/s, {gflops:.0f} GFLOP/s useful ({100 * gflops / limit:.0f}% of "
            f"the GEMM limit); {result['speedup']:.2f}x PyTorch"
        )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
