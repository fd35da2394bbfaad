"""Check that two benchmark JSON files (Headway's `bench --json`, bench_transformers.py --json)
generated the same token ids for every prompt; exits 1 and lists the prompts that differ.

Usage: python scripts/compare_token_ids.py bench-ar.json bench-transformers.json
"""

import json
import sys


def token_ids(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        report = json.load(f)
    return {p["question_id"]: p["token_ids"] for p in report["per_prompt"]}


def main() -> None:
    first, second = (token_ids(p) for p in sys.argv[1:3])
    differing = [q for q in first if first[q] != second.get(q)]
    for q in differing:
        print(f"question {q}: outputs differ")
    print(f"{len(first) - len(differing)} of {len(first)} prompts identical")
    sys.exit(1 if differing else 0)


if __name__ == "__main__":
    main()
