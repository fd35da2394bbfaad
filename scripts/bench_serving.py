#!/usr/bin/env python3
"""Many users at once: Headway's server beside llama.cpp's on one GGUF (issue 49).

`make bench-serving` runs it. For each concurrency (default 1, 4, 16, 64), one after another
and ROUNDS times, alternating:

1. ``headway-serve http`` on the GGUF with each ``--methods`` entry (default ``ar`` and
   ``lookup``), continuous batching up to ``--max-batch`` (default: the concurrency);
2. ``llama-server --parallel N`` (N = the concurrency, built from the source in PyPI's
   ``llama-cpp-python`` sdist: ``scripts/bench_llamacpp.py``) on the same GGUF and threads;

and ``headway-serve load`` against each: the first turns of the Spec-Bench questions, greedy,
``--max-tokens`` (128) each, ``max(16, 2 · N)`` requests, N in flight. It prints total tokens/s,
latency and time-to-first-token percentiles, and the ratios the issue asks for: each server
against its own one-client figure, and Headway against llama-server at the same concurrency.

Headway's greedy answers are checked against a reference server decoding one request at a time
(``--method ar --max-batch 1``, one thread, answering only after each load run): every answer
must be identical (``load --reference-url``).

Usage: scripts/bench_serving.py --headway-bin BIN_DIR [--concurrency 1,4,16,64] [--rounds 1]
       [--methods ar,lookup] [--json out.json]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from bench_llamacpp import build_llamacpp
from smollm2_gguf_path import add_source_arguments, smollm2_gguf

REFERENCE_PORT = 8190
PORT = 8191
# Context room of each llama-server slot: the longest Spec-Bench prompt and its reply fit.
SLOT_CONTEXT = 2048


def wait_healthy(url: str, process: subprocess.Popen, log: Path) -> None:
    """Waits until `url`/health answers 200; fails with the server's log if it exits."""
    for _ in range(600):
        if process.poll() is not None:
            sys.exit(f"the server exited ({process.returncode}):\n{log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    sys.exit(f"the server at {url} never became healthy:\n{log.read_text()[-4000:]}")


def start(command: list, url: str, logs: Path, name: str) -> subprocess.Popen:
    log = logs / f"{name}.log"
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log.open("w"))
    wait_healthy(url, process, log)
    return process


def stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def load(args, url: str, concurrency: int, reference: str | None, out: Path) -> dict:
    """One `headway-serve load` run; its figures (`--json`)."""
    requests = max(16, 2 * concurrency)
    command = [args.headway_bin / "headway-serve", "load", "--url", url,
               "--requests", str(requests), "--concurrency", str(concurrency),
               "--max-tokens", str(args.max_tokens), "--questions", args.questions,
               "--json", out]
    if reference:
        command += ["--reference-url", reference]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--headway-bin", type=Path, required=True, help="Headway's release binaries")
    parser.add_argument("--home", type=Path, default=Path(os.environ.get(
        "HEADWAY_HOME", Path.home() / ".cache" / "headway")))
    parser.add_argument("--concurrency", default="1,4,16,64")
    parser.add_argument("--methods", default="ar,lookup", help="Headway --method values")
    parser.add_argument("--max-batch", type=int, default=None,
                        help="Headway's --max-batch (default: the concurrency)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--no-llamacpp", action="store_true", help="Headway's servers only")
    parser.add_argument("--json", type=Path, default=None)
    add_source_arguments(parser)
    args = parser.parse_args()
    gguf = args.gguf or smollm2_gguf()
    llama_bin = None if args.no_llamacpp else build_llamacpp(args.home, os.cpu_count() or 2)
    logs = Path(tempfile.mkdtemp(prefix="bench-serving-"))
    http = [args.headway_bin / "headway-serve", "http", "--target", gguf]
    serve = [*http, "--threads", str(args.threads)]
    reference_url = f"http://127.0.0.1:{REFERENCE_PORT}"
    reference = start([*http, "--threads", "1", "--method", "ar", "--max-batch", "1",
                       "--port", str(REFERENCE_PORT)], reference_url, logs, "reference")
    url = f"http://127.0.0.1:{PORT}"
    rows = []
    try:
        for round_index in range(args.rounds):
            for concurrency in [int(c) for c in args.concurrency.split(",")]:
                servers = [(f"headway {m}", [*serve, "--method", m, "--port", str(PORT),
                                             "--max-batch", str(args.max_batch or concurrency),
                                             "--max-queue", str(4 * concurrency)], True)
                           for m in args.methods.split(",")]
                if llama_bin:
                    servers.append(("llama-server", [
                        llama_bin / "llama-server", "-m", gguf, "-t", str(args.threads),
                        "-np", str(concurrency), "-c", str(SLOT_CONTEXT * concurrency),
                        "--host", "127.0.0.1", "--port", str(PORT)], False))
                for name, command, checked in servers:
                    process = start(command, url, logs, name.replace(" ", "-"))
                    try:
                        figures = load(args, url, concurrency, reference_url if checked else None,
                                       logs / "load.json")
                    finally:
                        stop(process)
                    figures.update(server=name, round=round_index)
                    rows.append(figures)
                    print(f"round {round_index} concurrency {concurrency:>2} {name:<16} "
                          f"{figures['tokens_per_s']:7.1f} tokens/s, latency p50 "
                          f"{figures['latency_p50']:.2f} s p99 {figures['latency_p99']:.2f} s, "
                          f"first token p50 {figures['first_token_p50']:.2f} s, "
                          f"τ {figures['tau']:.2f}", flush=True)
    finally:
        stop(reference)
    print_table(rows)
    if args.json:
        partial = args.json.with_suffix(".partial")
        partial.write_text(json.dumps({"gguf": str(gguf), "threads": args.threads,
                                       "max_tokens": args.max_tokens, "runs": rows}, indent=2))
        partial.rename(args.json)


def print_table(rows: list) -> None:
    """Per server and concurrency: the mean over rounds, against one client and llama-server."""
    mean = {}
    for row in rows:
        mean.setdefault((row["server"], row["concurrency"]), []).append(row)
    rate = {key: sum(r["tokens_per_s"] for r in runs) / len(runs) for key, runs in mean.items()}
    print("\n| server | clients | tokens/s | × one client | × llama-server | latency p50 / p99 s "
          "| first token p50 / p99 s |")
    print("|---|---|---|---|---|---|---|")
    for (server, concurrency), runs in mean.items():
        tokens_per_s = rate[(server, concurrency)]
        one, peer = rate.get((server, 1)), rate.get(("llama-server", concurrency))
        average = lambda field: sum(r[field] for r in runs) / len(runs)  # noqa: E731
        cells = [server, str(concurrency), f"{tokens_per_s:.1f}",
                 f"{tokens_per_s / one:.2f}" if one else "–",
                 f"{tokens_per_s / peer:.2f}" if peer else "–",
                 f"{average('latency_p50'):.2f} / {average('latency_p99'):.2f}",
                 f"{average('first_token_p50'):.2f} / {average('first_token_p99'):.2f}"]
        print("| " + " | ".join(cells) + " |")

if __name__ == "__main__":
    main()
