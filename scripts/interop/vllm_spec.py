"""Serve Headway's exported heads with vLLM's own speculative decoding (`make interop-vllm`).

For each `METHOD=DIR` (methods as vLLM's `speculative_config` names them: eagle, eagle3, medusa)
builds `LLM(target, speculative_config={"method": METHOD, "model": DIR, ...})` on the CPU,
generates greedy replies to a few chat prompts, and compares them with the same `LLM` without
speculation. Prints vLLM's draft acceptance counters; exits 1 when a head fails to load, a reply
differs, or no drafted token was ever accepted (a head vLLM loads with wrong weights drafts junk).

    python scripts/interop/vllm_spec.py --target DIR eagle3=EXPORT_DIR [eagle=DIR medusa=DIR]
"""

import argparse
import sys

from vllm import LLM, SamplingParams

PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a short poem about the sea.",
    "Explain what a hash table is.",
    "List three uses of a paperclip.",
]


def replies(llm: LLM, max_tokens: int) -> list[list[int]]:
    conversations = [[{"role": "user", "content": p}] for p in PROMPTS]
    outputs = llm.chat(conversations, SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def accepted_counts(llm: LLM) -> tuple[float, float]:
    """vLLM's speculative counters: (drafted tokens, accepted tokens)."""
    drafted = accepted = 0.0
    for metric in llm.get_metrics():
        if metric.name == "vllm:spec_decode_num_draft_tokens":
            drafted += metric.value
        elif metric.name == "vllm:spec_decode_num_accepted_tokens":
            accepted += metric.value
    return drafted, accepted


def engine(target: str, speculative: dict | None) -> LLM:
    return LLM(
        model=target,
        dtype="float32",
        max_model_len=1024,
        enforce_eager=True,
        speculative_config=speculative,
        disable_log_stats=False,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--draft-tokens", type=int, default=3)
    parser.add_argument("heads", nargs="+", metavar="METHOD=DIR")
    args = parser.parse_args()

    plain = engine(args.target, None)
    reference = replies(plain, args.max_tokens)
    del plain
    failed = False
    for spec in args.heads:
        method, head = spec.split("=", 1)
        config = {"method": method, "model": head, "num_speculative_tokens": args.draft_tokens}
        try:
            llm = engine(args.target, config)
        except Exception as error:  # the point of the check: report any load failure and go on
            print(f"{method}: vLLM could not load {head}: {type(error).__name__}: {error}")
            failed = True
            continue
        got = replies(llm, args.max_tokens)
        same = sum(a == b for a, b in zip(got, reference))
        drafted, accepted = accepted_counts(llm)
        rate = accepted / drafted if drafted else 0.0
        print(f"{method}: {head} loaded; {same} of {len(PROMPTS)} greedy replies equal plain decoding's; drafted {drafted:.0f}, accepted {accepted:.0f} ({rate:.1%})")
        failed |= same != len(PROMPTS) or accepted == 0
        del llm
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
