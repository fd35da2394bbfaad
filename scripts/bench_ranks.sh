#!/usr/bin/env bash
# `make bench-ranks`: data-parallel head training on this machine (issue 24) — one process with
# one thread against two ranks over torch.distributed's Gloo on loopback with one thread each,
# the same global batch, alternating in one run. Prints training tokens/s (checkpoint writes and
# held-out evaluation not counted) and the ratio. Each micro-batch goes to the rank with the
# fewest padded tokens so far in its step, so more micro-batches per step even the ranks out.
#
#   RANKS_FEATURES  features to train on (default: made here from 48 ShareGPT conversations)
#   RANKS_HEAD      eagle (default), medusa or eagle3
#   RANKS_STEPS     optimizer steps per run (default 4)
#   RANKS_ACCUM     micro-batches of 2048 padded tokens per step, over all ranks (default 8)
#   RANKS_ROUNDS    alternations (default 2)
set -euo pipefail

: "${BIN:?set BIN to the directory of the release binaries}"
FEATURES=${RANKS_FEATURES:-/tmp/headway-bench-ranks}
HEAD=${RANKS_HEAD:-eagle}
STEPS=${RANKS_STEPS:-4}
ACCUM=${RANKS_ACCUM:-8}
ROUNDS=${RANKS_ROUNDS:-2}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

if ! "$BIN/headway-train" verify --features "$FEATURES" >/dev/null 2>&1; then
    "$BIN/headway-train" prepare --data sharegpt --max-seqs 48 --threads 2 --layers 2,15,27 \
        --out "$FEATURES"
fi
train() { # out, json
    echo "$HEAD" --features "$FEATURES" --out "$1" --steps "$STEPS" --grad-accum "$ACCUM" \
        --batch-tokens 2048 --threads 1 --save-every 100000 --json "$2"
}
figure() { # json → tokens/s
    "${PYTHON:-python3}" -c 'import json,sys; print(round(json.load(open(sys.argv[1]))["tokens_per_s"], 1))' "$1"
}
port=$((29500 + RANDOM % 1000))
for round in $(seq "$ROUNDS"); do
    # shellcheck disable=SC2046
    "$BIN/headway-train" $(train "$WORK/one-$round" "$WORK/one-$round.json") >/dev/null 2>&1
    for rank in 0 1; do
        # shellcheck disable=SC2046
        RANK=$rank WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
            "$BIN/headway-train" $(train "$WORK/two-$round" "$WORK/two-$round.json") \
            >/dev/null 2>"$WORK/two-$round-rank$rank.log" &
    done
    wait
    port=$((port + 1))
    one=$(figure "$WORK/one-$round.json")
    two=$(figure "$WORK/two-$round.json")
    ratio=$("${PYTHON:-python3}" -c "print(f'{$two / $one:.2f}')")
    echo "round $round: $HEAD, $STEPS steps × $ACCUM micro-batches of 2048 tokens: 1 rank $one tokens/s, 2 ranks (Gloo) $two tokens/s = ${ratio}×"
done
