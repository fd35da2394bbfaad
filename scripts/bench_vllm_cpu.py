"""vLLM's CPU build on the prompts of `scripts/bench_llamacpp.py` (run by it, with the vLLM venv's
Python): greedy, f32, batch 1 prompt by prompt, then all prompts as one batch.

Batch-1 decoding rate as the other tools count it: new tokens after the first over the time after
the first, the first token's time measured by a separate `max_tokens=1` request for the same
prompt (prefill plus one step; vLLM's request metrics are not filled in offline mode). Writes one
JSON object.

    python scripts/bench_vllm_cpu.py --model HF_DIR --prompts prompts.json --threads 2 \
        --max-new-tokens 128 --json out.json
"""

import argparse
import json
import os
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="the target as an HF directory (f32)")
    parser.add_argument("--prompts", type=Path, required=True, help="JSON list of rendered prompts")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args()
    # vLLM's CPU worker binds its OpenMP threads to these cores; set before vLLM is imported.
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{args.threads - 1}")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams

    prompts = json.loads(args.prompts.read_text())
    llm = LLM(model=args.model, dtype="float32", max_model_len=2048, seed=0)
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_new_tokens)
    first = SamplingParams(temperature=0.0, max_tokens=1)
    llm.generate(prompts[:1], greedy, use_tqdm=False)  # warm-up: compilation, caches

    totals = {"prompt_tokens": 0, "prefill_s": 0.0, "new_tokens": 0, "decode_s": 0.0}
    replies = []
    for prompt in prompts:
        start = time.perf_counter()
        llm.generate([prompt], first, use_tqdm=False)
        first_s = time.perf_counter() - start
        start = time.perf_counter()
        out = llm.generate([prompt], greedy, use_tqdm=False)[0]
        whole_s = time.perf_counter() - start
        new = len(out.outputs[0].token_ids)
        replies.append(list(out.outputs[0].token_ids))
        totals["prompt_tokens"] += len(out.prompt_token_ids)
        totals["prefill_s"] += first_s
        totals["new_tokens"] += new - 1
        totals["decode_s"] += max(whole_s - first_s, 1e-9)

    start = time.perf_counter()
    batch = llm.generate(prompts, greedy, use_tqdm=False)
    batch_s = time.perf_counter() - start
    batch_tokens = sum(len(o.outputs[0].token_ids) for o in batch)

    args.json.write_text(json.dumps({
        "version": __import__("vllm").__version__,
        "prompt_tokens": totals["prompt_tokens"],
        "new_tokens": totals["new_tokens"],
        "prefill_tokens_per_s": totals["prompt_tokens"] / totals["prefill_s"],
        "decode_tokens_per_s": totals["new_tokens"] / totals["decode_s"],
        "batch_prompts": len(prompts),
        "batch_tokens_per_s": batch_tokens / batch_s,
        "replies": replies,
    }))


if __name__ == "__main__":
    main()
