#!/usr/bin/env bash
# `make demo`: the whole Headway pipeline on the embedded default target (SmolLM2-135M-Instruct),
# about 12 minutes on 2 CPU cores once built:
#   1. prepare 200 ShareGPT conversations (target features)
#   2. train an EAGLE head and Medusa heads on them
#   3. bench EAGLE against plain decoding on a Spec-Bench subset
#   4. start the OpenAI-compatible server, ask it one chat question, print the answer, τ, speedup
# Steps whose output exists are skipped, so a rerun goes straight to the bench and the server.
# The committed head in pretrained/ (trained longer, see pretrained/README.md) is used for the
# bench and the server when present; the demo's own head shows the training path.
set -euo pipefail

: "${BIN:?set BIN to the directory of the release binaries}"
: "${HEADWAY_HOME:?}"
QUESTIONS=${QUESTIONS:-../shared/data/spec_bench/question.jsonl}
WORK=${DEMO_DIR:-$HEADWAY_HOME/demo}
PRETRAINED=pretrained/smollm2-135m-eagle
mkdir -p "$WORK"

step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

step "1/4 prepare: 200 ShareGPT conversations -> SmolLM2 features in $WORK/features"
"$BIN/headway-train" prepare --data sharegpt --out "$WORK/features" --max-seqs 200 --max-len 1024

step "2/4 train: an EAGLE head (2 epochs) and 4 Medusa heads (1 epoch), draft vocabulary 8192"
if [ ! -f "$WORK/eagle/latest" ]; then
    "$BIN/headway-train" eagle --features "$WORK/features" --out "$WORK/eagle" --epochs 2 \
        --draft-vocab 8192 --lr 1e-3 --warmup 30
fi
if [ ! -f "$WORK/medusa/latest" ]; then
    "$BIN/headway-train" medusa --features "$WORK/features" --out "$WORK/medusa" --epochs 1 \
        --draft-vocab 8192
fi
"$BIN/headway-train" eval --heads "$WORK/eagle" --features "$WORK/features"

HEAD="$WORK/eagle"
if [ -f "$PRETRAINED/config.json" ]; then
    HEAD=$PRETRAINED
    echo "bench and server use the committed head $PRETRAINED (made as pretrained/README.md says)"
fi

step "3/4 bench: EAGLE vs plain decoding, 6 Spec-Bench questions, 96 new tokens each"
"$BIN/headway-serve" bench --method eagle --heads "$HEAD" --tree-tokens auto --questions "$QUESTIONS" --limit 6 \
    --turns 1 --max-new-tokens 96 --json "$WORK/bench-eagle.json"

step "4/4 serve: headway-serve http --method eagle, one chat request"
PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
"$BIN/headway-serve" http --method eagle --heads "$HEAD" --tree-tokens auto --port "$PORT" 2>"$WORK/server.log" &
SERVER=$!
trap 'kill -TERM $SERVER 2>/dev/null || true' EXIT
python3 - "$PORT" "$WORK/bench-eagle.json" <<'PY'
import json, sys, time, urllib.request

port, bench = sys.argv[1], sys.argv[2]
base = f"http://127.0.0.1:{port}"
for _ in range(600):
    try:
        urllib.request.urlopen(f"{base}/health", timeout=1)
        break
    except OSError:
        time.sleep(0.2)
request = {
    "messages": [{"role": "user", "content": "Explain in three sentences why the sky is blue."}],
    "max_tokens": 128,
    "temperature": 0,
}
started = time.time()
reply = json.load(urllib.request.urlopen(urllib.request.Request(
    f"{base}/v1/chat/completions", json.dumps(request).encode(),
    {"Content-Type": "application/json"})))
seconds = time.time() - started
answer = reply["choices"][0]["message"]["content"]
spec = reply["speculative"]
tokens = reply["usage"]["completion_tokens"]
print(f"\n{answer}\n")
print(f"{tokens} tokens in {seconds:.2f} s ({tokens / seconds:.1f} tokens/s), "
      f"{spec['target_forwards']} target forwards: tau {spec['tau']:.2f}")
report = json.load(open(bench))
print(f"bench: tau {report['tau']:.2f}, {report['tokens_per_s']:.1f} tokens/s, "
      f"speedup vs plain decoding {report['speedup_vs_ar']:.2f}x "
      f"(formula: {report['predicted_speedup']:.2f}x)")
PY
