#!/usr/bin/env bash
# The prepared GPU check (issues 20 and 21): on one CUDA device, in under 8 minutes, extract
# EAGLE-3 features for 400 ShareGPT conversations, train a few hundred EAGLE-3 steps, evaluate the
# head and bench it, then the committed EAGLE head, against plain decoding on 8 Spec-Bench
# questions with EAGLE-2's 60-token trees. Each bench compares greedy outputs with plain
# decoding's and reports how many prompts are identical: on CUDA verification runs libtorch's
# kernels, whose results may differ in the last bits from decoding's (README, "Exactness").
#
# Needs the release binaries (`make build`: they link libtorch_cuda), the converted target and
# ShareGPT under HEADWAY_HOME (`make model data`) and the questions file. A machine whose torch
# 2.11.0 lives elsewhere than the build's venv: set TORCH_LIB to its lib directory.
#
#   scripts/gpu_eagle3.sh OUT_DIR [QUESTIONS]
set -euo pipefail

out=${1:?usage: scripts/gpu_eagle3.sh OUT_DIR [QUESTIONS]}
questions=${2:-../shared/data/spec_bench/question.jsonl}
bin=${BIN:-${CARGO_TARGET_DIR:-$HOME/.cache/headway/target}/release}
if [[ -n "${TORCH_LIB:-}" ]]; then
    export LD_LIBRARY_PATH="$TORCH_LIB:${LD_LIBRARY_PATH:-}"
fi
mkdir -p "$out"
step() { echo "== $(date +%T) $*"; }

step "features: 400 conversations, taps 2,15,27, bf16 target on cuda"
timeout 120 "$bin/headway-train" prepare --data sharegpt --max-seqs 400 --max-len 512 \
    --layers 2,15,27 --device cuda --target-dtype bf16 --out "$out/features" --json "$out/prepare.json"

step "EAGLE-3: 300 steps of 16k padded tokens under bf16 autocast"
timeout 150 "$bin/headway-train" eagle3 --features "$out/features" --out "$out/head" --device cuda \
    --steps 300 --batch-tokens 16384 --lr 1e-3 --warmup 20 --draft-vocab 8192 --save-every 100000 \
    --json "$out/train.json"

step "bench: 8 questions, 128 new tokens, 60-token trees against plain decoding (EAGLE-3, then EAGLE)"
timeout 90 "$bin/headway-serve" bench --device cuda --method eagle3 --heads "$out/head" \
    --tree-tokens 60 --depth 6 --tree-top-k 10 --questions "$questions" --limit 8 --turns 1 \
    --max-new-tokens 128 --json "$out/bench.json"
timeout 90 "$bin/headway-serve" bench --device cuda --method eagle --heads pretrained/smollm2-135m-eagle \
    --tree-tokens 60 --depth 6 --tree-top-k 10 --questions "$questions" --limit 8 --turns 1 \
    --max-new-tokens 128 --json "$out/bench-eagle.json"
step "done: $out/{prepare,train,bench,bench-eagle}.json"
