#!/usr/bin/env python3
"""Regenerate the Python-reference fixtures under ``fixtures/``.

Headway's Rust side (tokenizer, chat template, SmolLM2 forward pass, greedy
decoding) is checked against Hugging Face ``transformers`` running the same
GGUF file (SmolLM2-135M-Instruct, Q4_1, de-quantised to f32).  This script
produces those reference outputs; it is only needed when the fixtures must be
regenerated, the Rust tests just read the committed files.

Files written into ``--out`` (default ``fixtures/``):

``tokenizer_ids.json``
    ``tok(text, add_special_tokens=False)["input_ids"]`` for every turn of all
    480 Spec-Bench prompts (``spec_bench/<question_id>/turn<k>``) and for
    hand-picked edge cases (``edge/<what>``: numbers, emoji, CJK, code,
    whitespace runs, inline special tokens, ...).  Edge cases also carry
    ``decoded`` = ``tok.decode(ids)``.
``chat_template.json``
    ``tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=..)``
    for a few conversations, plus the ids of the rendered text.
``reference_logits.safetensors``
    ``prompt{i}.input_ids`` (int64 [T]) and ``prompt{i}.logits`` (f32 [T, vocab]):
    the full logits of one forward pass over each of three short prompts.  The
    prompt texts are stored in the safetensors metadata under ``prompt{i}``.
``greedy_reference.json``
    ``model.generate(max_new_tokens=64, do_sample=False)`` continuations (new
    tokens only) for three chat prompts rendered with the generation prompt.

Everything runs on the CPU in f32 with ``torch.set_num_threads(2)``, so the
output is deterministic for a given torch / transformers version (recorded in
each file).

Usage (from the repository root)::

    ~/.cache/headway/venv/bin/python scripts/make_fixtures.py
    ~/.cache/headway/venv/bin/python scripts/make_fixtures.py \\
        --gguf /path/to/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --questions ../shared/data/spec_bench/question.jsonl --out fixtures/
"""

import argparse
import json
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from smollm2_gguf_path import add_source_arguments, smollm2_gguf

GENERATOR = "scripts/make_fixtures.py"
REPO_ROOT = Path(__file__).resolve().parent.parent
THREADS = 2
GREEDY_MAX_NEW_TOKENS = 64

EDGE_CASES = [
    ("digits", "12345"),
    ("decimal", "3.14159"),
    ("thousands_separators", "1,000,000"),
    ("iso_date", "2024-01-01"),
    ("numbers_in_sentence", "In 2023 we sold 4,096 units at $19.99 each (a 7.5% rise)."),
    ("emoji", "Hello 👋 world 🌍! 😀😂🎉"),
    ("emoji_zwj_family", "👨‍👩‍👧‍👦 and 🧑‍💻"),
    ("emoji_flags", "🇺🇸🇯🇵🇩🇪🇫🇷"),
    ("emoji_skin_tone", "👍🏽👋🏿"),
    ("chinese", "你好，世界！今天天气很好。"),
    ("japanese", "こんにちは、世界。カタカナと漢字を混ぜます。"),
    ("korean", "안녕하세요, 세계! 반갑습니다."),
    ("arabic", "مرحبا بالعالم، كيف حالك؟"),
    ("hindi", "नमस्ते दुनिया, आप कैसे हैं?"),
    ("code_python", "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n"),
    (
        "code_rust",
        'fn main() {\n    let v: Vec<u32> = (0..10).map(|x| x * x).collect();\n'
        '    for (i, x) in v.iter().enumerate() {\n        println!("{i}: {x}");\n    }\n}\n',
    ),
    ("multiple_spaces", "a  b   c    d         e"),
    ("tabs", "\tindented\t\ttwice\t"),
    ("triple_newline", "\n\n\n"),
    ("paragraphs", "First line.\n\nSecond paragraph.\n\n\nThird."),
    ("trailing_spaces", "trailing spaces   "),
    ("leading_space", " leading space"),
    ("mixed_whitespace", "  \n\t \r\n  x \u00a0y"),
    ("single_space", " "),
    ("empty", ""),
    ("special_tokens_chat", "<|im_start|>user\nHello<|im_end|>\n"),
    ("special_token_endoftext", "<|endoftext|>"),
    ("special_token_in_text", "before<|endoftext|>after <|im_end|> done"),
    ("url", "https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct?rev=main&x=1#usage"),
    ("contractions", "I'm sure DON'T worry, we'll see. They've It's YOU'RE"),
    ("accented_latin", "Café naïve résumé Ångström façade Zürich São Paulo Łódź"),
    ("combining_accent", "Cafe\u0301 vs Caf\u00e9"),
    ("zero_width", "zero\u200bwidth\u200djoiner"),
    ("long_word", "Pneumonoultramicroscopicsilicovolcanoconiosis"),
    ("long_char_run", "a" * 200),
    ("repeated_punctuation", "Wait...... what?!?!?! ---- **** !!!!!!!! ......"),
    ("mixed_scripts", "English, 中文, русский, Ελληνικά, עברית — all in one line."),
]

CHAT_CASES = [
    ("user_only_generation_prompt", [{"role": "user", "content": "What is the capital of France?"}], True),
    ("user_only_no_generation_prompt", [{"role": "user", "content": "What is the capital of France?"}], False),
    (
        "system_and_user",
        [
            {"role": "system", "content": "You are a terse assistant. Answer in one word."},
            {"role": "user", "content": "What is the capital of France?"},
        ],
        True,
    ),
    (
        "multi_turn",
        [
            {"role": "user", "content": "Name a prime number."},
            {"role": "assistant", "content": "7 is a prime number."},
            {"role": "user", "content": "Name a larger one."},
        ],
        True,
    ),
    (
        "assistant_last",
        [
            {"role": "user", "content": "Say hello."},
            {"role": "assistant", "content": "Hello! How can I help you today?"},
        ],
        False,
    ),
    (
        "system_multi_turn",
        [
            {"role": "system", "content": "Reply in French."},
            {"role": "user", "content": "Good morning!"},
            {"role": "assistant", "content": "Bonjour !"},
            {"role": "user", "content": "How are you?"},
        ],
        True,
    ),
]

# Short prompts (8-16 tokens each) so that the [T, 49152] f32 logits stay small.
LOGIT_PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "def add(a, b):\n    return a + b",
]

CODING_REQUEST = "Write a Python function that checks whether a string is a palindrome."


def load_tokenizer(gguf: Path):
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


def load_model(gguf: Path):
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    return model.eval()


def load_questions(path: Path) -> list[dict]:
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def encode(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def write_json(path: Path, header: dict, cases: list[dict]) -> None:
    """Write ``{**header, "cases": [...]}`` with one case per line (readable diffs, small files)."""
    head = json.dumps(header, ensure_ascii=False)[:-1]
    sep = ", " if header else ""
    rows = ",\n".join("  " + json.dumps(c, ensure_ascii=False) for c in cases)
    path.write_text(f'{head}{sep}"cases": [\n{rows}\n]}}\n', encoding="utf-8")


def sort_safetensors_metadata(path: Path) -> None:
    """Rewrite the header of a safetensors file with its ``__metadata__`` keys sorted.

    ``save_file`` serialises the metadata from a hash map, so its key order (and thus the
    file's bytes) changes from run to run; sorting it makes regenerated fixtures byte-identical.
    """
    with path.open("r+b") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
        header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
        raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
        if len(raw) > size:
            raise SystemExit(f"{path}: re-serialised header is longer than the original")
        f.seek(8)
        f.write(raw.ljust(size, b" "))


def versions() -> dict:
    return {"generator": GENERATOR, "transformers": transformers.__version__, "torch": torch.__version__}


def tokenizer_cases(tok, questions: list[dict]) -> list[dict]:
    cases = []
    for q in questions:
        for k, text in enumerate(q["turns"], start=1):
            cases.append({"name": f"spec_bench/{q['question_id']}/turn{k}", "text": text, "ids": encode(tok, text)})
    for what, text in EDGE_CASES:
        ids = encode(tok, text)
        cases.append({"name": f"edge/{what}", "text": text, "ids": ids, "decoded": tok.decode(ids)})
    return cases


def chat_cases(tok) -> list[dict]:
    cases = []
    for name, messages, add_gen in CHAT_CASES:
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_gen)
        cases.append(
            {"name": name, "messages": messages, "add_generation_prompt": add_gen, "text": text, "ids": encode(tok, text)}
        )
    return cases


@torch.inference_mode()
def reference_logits(model, tok) -> tuple[dict, dict]:
    tensors, metadata = {}, {}
    for i, text in enumerate(LOGIT_PROMPTS):
        ids = torch.tensor(encode(tok, text), dtype=torch.int64)
        if not 8 <= ids.numel() <= 16:
            raise SystemExit(f"logit prompt {i} has {ids.numel()} tokens, want 8-16: {text!r}")
        logits = model(ids.unsqueeze(0)).logits[0].to(torch.float32).contiguous()
        tensors[f"prompt{i}.input_ids"] = ids
        tensors[f"prompt{i}.logits"] = logits
        metadata[f"prompt{i}"] = text
    return tensors, metadata


@torch.inference_mode()
def greedy_cases(model, tok, questions: list[dict]) -> list[dict]:
    by_id = {q["question_id"]: q for q in questions}
    prompts = [
        by_id[141]["turns"][0],  # stem: explanation question
        by_id[441]["turns"][0],  # math_reasoning: word problem
        CODING_REQUEST,
    ]
    eos = model.generation_config.eos_token_id
    cases = []
    for content in prompts:
        messages = [{"role": "user", "content": content}]
        prompt_text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        prompt_ids = encode(tok, prompt_text)
        input_ids = torch.tensor([prompt_ids], dtype=torch.int64)
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=GREEDY_MAX_NEW_TOKENS,
            do_sample=False,
        )
        new = out[0, len(prompt_ids):].tolist()
        cases.append(
            {
                "messages": messages,
                "prompt_text": prompt_text,
                "prompt_ids": prompt_ids,
                "generated_ids": new,
                "generated_text": tok.decode(new),
                "stopped_at_eos": bool(new) and new[-1] == eos,
            }
        )
    return cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_source_arguments(parser)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "fixtures", help="output directory")
    args = parser.parse_args()
    gguf = args.gguf or smollm2_gguf()

    torch.set_num_threads(THREADS)
    args.out.mkdir(parents=True, exist_ok=True)
    questions = load_questions(args.questions)
    tok = load_tokenizer(gguf)
    written = []

    path = args.out / "tokenizer_ids.json"
    write_json(path, versions(), tokenizer_cases(tok, questions))
    written.append(path)

    path = args.out / "chat_template.json"
    write_json(path, versions(), chat_cases(tok))
    written.append(path)

    model = load_model(gguf)

    path = args.out / "reference_logits.safetensors"
    tensors, metadata = reference_logits(model, tok)
    save_file(tensors, str(path), metadata={**metadata, **versions()})
    sort_safetensors_metadata(path)
    written.append(path)

    path = args.out / "greedy_reference.json"
    header = {**versions(), "max_new_tokens": GREEDY_MAX_NEW_TOKENS, "eos_token_id": model.generation_config.eos_token_id}
    write_json(path, header, greedy_cases(model, tok, questions))
    written.append(path)

    total = 0
    for p in written:
        size = p.stat().st_size
        total += size
        print(f"wrote {p} ({size:,} bytes)")
    print(f"total {total:,} bytes")


if __name__ == "__main__":
    main()
