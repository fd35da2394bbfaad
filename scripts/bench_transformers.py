#!/usr/bin/env python3
"""Hugging Face ``transformers`` baseline for Headway's plain-decoding benchmark.

Loads SmolLM2-135M-Instruct from the same GGUF file the Rust side uses
(de-quantised to f32), runs on the CPU with a fixed number of threads, and
greedily generates (``generate(max_new_tokens=128, do_sample=False)``, stopping
at EOS as usual) for 8 Spec-Bench prompts: the first turn of the questions at
line indices 0, 60, 120, ..., 420 of ``question.jsonl`` (one per 60-row block),
each rendered with the chat template and the generation prompt.

One untimed warm-up generation runs first; then every ``generate()`` call is
timed with ``time.perf_counter``.  The summary reports
``tokens_per_s = total new tokens / total seconds``.

Usage (from the repository root)::

    ~/.cache/headway/venv/bin/python scripts/bench_transformers.py
    ~/.cache/headway/venv/bin/python scripts/bench_transformers.py \\
        --threads 2 --max-new-tokens 128 --json /tmp/bench_transformers.json
"""

import argparse
import json
import time
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

from smollm2_gguf_path import add_source_arguments, smollm2_gguf

QUESTION_STRIDE = 60
NUM_PROMPTS = 8


def select_questions(path: Path) -> list[dict]:
    """Rows 0, 60, ..., 420 of question.jsonl (one per 60-row block)."""
    with path.open(encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return rows[::QUESTION_STRIDE][:NUM_PROMPTS]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_source_arguments(parser)
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--json", type=Path, default=None, help="write the results to this JSON file")
    args = parser.parse_args()
    gguf = args.gguf or smollm2_gguf()

    torch.set_num_threads(args.threads)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()

    prompts = []
    for q in select_questions(args.questions):
        messages = [{"role": "user", "content": q["turns"][0]}]
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]], dtype=torch.int64)
        prompts.append((q, ids))
        print(f"question_id={q['question_id']} category={q['category']} prompt_tokens={ids.shape[1]}")

    def generate(ids: torch.Tensor) -> torch.Tensor:
        return model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens, do_sample=False
        )

    with torch.inference_mode():
        generate(prompts[0][1])  # untimed warm-up
        per_prompt = []
        for q, ids in prompts:
            start = time.perf_counter()
            out = generate(ids)
            seconds = time.perf_counter() - start
            new_tokens = out.shape[1] - ids.shape[1]
            per_prompt.append(
                {
                    "question_id": q["question_id"],
                    "category": q["category"],
                    "prompt_tokens": ids.shape[1],
                    "new_tokens": new_tokens,
                    "seconds": seconds,
                    # For `headway-serve compare`-style checks: greedy ids must equal Headway's.
                    "token_ids": out[0, ids.shape[1] :].tolist(),
                }
            )
            print(f"question_id={q['question_id']}: {new_tokens} new tokens in {seconds:.3f} s")

    total_tokens = sum(p["new_tokens"] for p in per_prompt)
    total_seconds = sum(p["seconds"] for p in per_prompt)
    result = {
        "method": "transformers",
        "prompts": len(per_prompt),
        "new_tokens": total_tokens,
        "seconds": total_seconds,
        "tokens_per_s": total_tokens / total_seconds,
        "threads": args.threads,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "per_prompt": per_prompt,
    }
    print(
        f"prompts={result['prompts']} new_tokens={total_tokens} seconds={total_seconds:.3f} "
        f"tokens_per_s={result['tokens_per_s']:.2f}"
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
